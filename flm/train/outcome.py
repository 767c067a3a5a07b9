"""A step's outcome read one step late, so that the host never waits for the GPU between steps.

The skip of a non-finite step is decided on the device (flm.train.optim.optimizer_step); the host
copies the step's [finite, grad norm, each network's loss] without waiting and reads them after it has issued the
next step's forward and backward (or at once on steps that log, save or finish). Reading counts the
step: a non-finite one is warned about, and `max_nonfinite` of them in a row stop the run.
"""

import dataclasses
import logging
import math

import torch

log = logging.getLogger("flm")


@dataclasses.dataclass
class Numbers:
    """Plain counters kept in a checkpoint as a dict of their fields."""

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in state:  # a field newer than the checkpoint keeps its default
                setattr(self, f.name, type(getattr(self, f.name))(state[f.name]))


@dataclasses.dataclass
class NonFinite(Numbers):
    total: int = 0
    in_a_row: int = 0


@dataclasses.dataclass
class LossWindow(Numbers):
    """Each network's logged loss is its mean over the steps since the last log that trained it (a DMD student
    and its fake score alternate); carried over a resume. The trained model's sum and steps keep their own fields."""

    loss_sum: float = 0.0
    steps: int = 0
    others: dict = dataclasses.field(default_factory=dict)  # an extra network -> [loss sum, steps]

    def add(self, network: str, loss: float) -> None:
        loss = loss if math.isfinite(loss) else 0.0  # a skipped step counts, with nothing added
        if network == "model":
            self.loss_sum, self.steps = self.loss_sum + loss, self.steps + 1
        else:
            total, steps = self.others.get(network, (0.0, 0))
            self.others[network] = [total + loss, steps + 1]

    def means(self) -> dict[str, float]:
        """{network: mean loss} of the networks trained since the last log, and a new window."""
        sums = {"model": (self.loss_sum, self.steps), **{name: tuple(v) for name, v in self.others.items()}}
        self.loss_sum, self.steps, self.others = 0.0, 0, {}
        return {name: total / steps for name, (total, steps) in sums.items() if steps}


def to_host_async(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a small tensor to the host without waiting: (host tensor, event to wait on)."""
    if values.device.type != "cuda":
        return values.cpu(), None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class Outcomes:
    """The pending step's outcome, the non-finite counters and the loss window."""

    def __init__(self, max_nonfinite: int, describe=lambda: ""):
        self.max_nonfinite, self.describe = max_nonfinite, describe  # describe(): what a skipped step's warning adds
        self.nonfinite, self.window = NonFinite(), LossWindow()
        self.pending = None  # (step, the networks, host copy of [finite, grad norm, their losses], event)

    def record(self, step: int, losses: dict[str, torch.Tensor], finite: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Start reading this step's outcome ({network: its loss}); settle() reads it."""
        values = torch.stack([finite, grad_norm.detach().float(), *(v.detach().float() for v in losses.values())])
        self.pending = (step, tuple(losses), *to_host_async(values))

    def settle(self) -> None:
        """Read the pending step's outcome: count it, warn about a skip, stop after too many in a row."""
        if self.pending is None:
            return
        (step, networks, values, event), self.pending = self.pending, None
        if event is not None:
            event.synchronize()
        finite, norm, *losses = values.tolist()
        losses = dict(zip(networks, losses))
        counts = self.nonfinite
        if finite == 1.0:
            counts.in_a_row = 0
        else:
            counts.total, counts.in_a_row = counts.total + 1, counts.in_a_row + 1
            loss = losses["model"] if list(losses) == ["model"] else losses  # the warning names a lone model's loss plainly
            log.warning(
                f"step {step}: non-finite loss {loss} or grad norm {norm}; "
                f"skipped ({counts.in_a_row} in a row, {counts.total} in total){self.describe()}"
            )
            if counts.in_a_row >= self.max_nonfinite:
                raise FloatingPointError(
                    f"{counts.in_a_row} non-finite steps in a row (last at step {step}); training stopped. "
                    f"Lower optim.lr, raise optim.warmup_steps or keep optim.grad_clip > 0, then resume "
                    f"from the last checkpoint"
                )
        for network, value in losses.items():
            self.window.add(network, value)

    def mean_losses(self) -> dict[str, float]:
        """The window's mean loss of each network it trained (this rank's), and a new window."""
        return self.window.means()
