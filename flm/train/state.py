"""Everything a run's checkpoint holds, in one object: TrainState.

    state = TrainState(model=raw, wrapped=model, ema=ema, objective=objective, optimizers={"model": opt},
                       loader=loader, device=device, model_args=model_args, config=config, max_nonfinite=10)
    state.load_state_dict(checkpoint.load(path), source=path)     # resume
    state.save(run_dir, keep_last=2)                              # every rank; rank 0 writes

`parts()` names the checkpoint's contents once; saving and resuming both read it. Any number of
networks and optimizers fit: the trained model (key "model", its EMAs "ema", its optimizer
"optimizer" and schedule "scheduler"), and each trainable network an objective declares (a
distillation's fake score: keys "<name>", "<name>.optimizer", "<name>.scheduler"). A frozen network (a
teacher) is built again from its objective's declaration and is not saved.

Networks, EMAs and optimizers hold whole tensors in the bundle (gathered from FSDP2's shards), so a
checkpoint resumes under one process, DDP or FSDP2, with any number of ranks.
"""

import math
from collections.abc import Mapping

import torch
from torch import nn

from flm import dist
from flm.train import checkpoint
from flm.train.ema import EMA
from flm.train.optim import Optimizer
from flm.train.outcome import Outcomes
from flm.train.parallel import local


class Part:
    """A checkpoint part from a getter and a loader (for what has no state_dict of its own)."""

    def __init__(self, state_dict, load_state_dict):
        self.state_dict, self.load_state_dict = state_dict, load_state_dict


class RNG:
    """The process's torch (and CUDA) generator states."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


class Weights:
    """A network's weights as whole tensors on the CPU (every rank calls both: FSDP2 gathers/scatters)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def state_dict(self) -> dict:
        return checkpoint.model_state(self.module)

    def load_state_dict(self, state: dict) -> None:
        checkpoint.load_model_state(self.module, state)


def key(network: str, part: str) -> str:
    """The bundle key of a network's part: the trained model's keep their plain names ("optimizer")."""
    return part if network == "model" else f"{network}.{part}"


class TrainState:
    """The networks (the trained model, raw and as it is called, and an objective's extra ones), the
    model's EMAs, the optimizers with their schedules, the objective, the loader's position, the RNG,
    the step, the non-finite counters and the loss window; plus what the bundle records for sample.py
    (model_args, config)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        wrapped: nn.Module,
        ema: EMA,
        objective,
        optimizers: dict[str, Optimizer],
        loader,
        device: torch.device,
        model_args: dict,
        config: dict,
        max_nonfinite: int,
        trainable: dict[str, nn.Module] | None = None,
        extras: dict[str, nn.Module] | None = None,
    ):
        self.model, self.wrapped, self.ema, self.objective = model, wrapped, ema, objective
        self.optimizers, self.loader, self.model_args, self.config = optimizers, loader, model_args, config
        self.trainable = trainable or {}  # the objective's trainable networks, unwrapped (saved)
        self.extras = extras or {}  # every network the objective declares, as its loss receives them
        self.rng, self.outcomes, self.step = RNG(device), Outcomes(max_nonfinite, describe=self.nonfinite_grads), 0

    def nonfinite_grads(self, shown: int = 4) -> str:
        """For a skipped step's warning, read while the next step's gradients are in place (the host reads an
        outcome one step late): the parameters whose gradient is not finite, or, when all are finite, the
        largest ones (their norm can overflow); "" when there are no gradients (after the update)."""
        peaks = {name: peak for opt in self.optimizers.values() for name, peak in opt.grad_peaks().items()}
        if not peaks:
            return ""
        bad = [name for name, peak in peaks.items() if not math.isfinite(peak)]
        if bad:
            listed = ", ".join(bad[:shown]) + (f" and {len(bad) - shown} more" if len(bad) > shown else "")
            return f"; the gradients of step {self.step} (the next) are not finite in {len(bad)} tensors: {listed}"
        top = sorted(peaks, key=peaks.get, reverse=True)[:shown]
        listed = ", ".join(f"{name} ({peaks[name]:.2g})" for name in top)
        return f"; the gradients of step {self.step} (the next) are finite, the largest max |g|: {listed}"

    def parts(self, source: str = "the checkpoint") -> dict:
        """The checkpoint's contents, in load order: the records that a resume checks come first."""
        parts = {
            "model_args": Part(
                lambda: self.model_args, lambda saved: checkpoint.check_model_args(source, saved, self.model_args)
            ),
            "config": Part(lambda: self.config, lambda saved: checkpoint.check_objective(source, saved, self.config)),
            "model": Weights(self.model),
            "ema": self.ema,
            **{name: Weights(net) for name, net in self.trainable.items()},
            "objective": Part(self.objective.state_dict, lambda saved: checkpoint.load_objective(source, saved, self.objective)),
        }
        for name, opt in self.optimizers.items():
            parts |= {key(name, "optimizer"): opt, key(name, "scheduler"): opt.schedule}
        return parts | {
            "data": self.loader,
            "rng": self.rng,
            "step": Part(lambda: self.step, self._set_step),
            "nonfinite": self.outcomes.nonfinite,
            "log_window": self.outcomes.window,
        }

    def _set_step(self, step) -> None:
        self.step = int(step)

    def state_dict(self) -> dict:
        """The bundle; every rank calls it (whole tensors gathered), rank 0's is complete."""
        return {name: part.state_dict() for name, part in self.parts().items()}

    def load_state_dict(self, bundle: dict, source: str = "the checkpoint") -> None:
        parts = self.parts(source)
        missing = [name for name in parts if name not in bundle]
        if missing:
            raise ValueError(
                f"checkpoint {source!r} lacks {', '.join(missing)}: it was written by another version "
                f"of flm or for another objective; resume from a checkpoint of this run, or start anew"
            )
        for name, part in parts.items():
            part.load_state_dict(bundle[name])

    def save(self, run_dir: str, keep_last: int) -> None:
        """The step's checkpoint; a collective under FSDP2, written by rank 0."""
        bundle = self.state_dict()
        if dist.is_main():
            checkpoint.save(bundle, checkpoint.checkpoint_path(run_dir, self.step), keep_last=keep_last)
        dist.barrier()

    @property
    def sampled(self) -> nn.Module:
        """What grids and in-training evaluations sample: the first EMA, or the raw weights of a run without one."""
        return self.model if self.ema.default is None else self.ema.default

    def modules(self) -> list[nn.Module]:
        """What the optimizers change: the model, the objective and its trainable networks."""
        return [self.model, self.objective, *self.trainable.values()]

    @torch.no_grad()
    def check_finite_weights(self, run_dir: str) -> None:
        """Stop before non-finite weights are logged as trained or saved: an update can overflow although
        its loss and gradients were finite (a huge learning rate), and the step skip only sees those."""
        modules = self.modules() + list(self.ema.models.values())
        tensors = [local(p) for m in modules for p in m.parameters()]
        finite = dist.all_min(torch.stack(torch._foreach_norm(tensors)).isfinite().all().float())  # one host sync
        if finite.item() != 1.0:
            saved = checkpoint.list_checkpoints(run_dir)
            latest = f"the latest checkpoint is still {saved[-1]}" if saved else "no checkpoint yet"
            raise FloatingPointError(
                f"the weights are not finite after step {self.step} (an update overflowed at learning rate "
                f"{self.optimizers['model'].lr:g}); nothing was saved from them ({latest}). "
                f"Lower optim.lr, then resume from the last checkpoint or start anew"
            )

    def losses(self, loss) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
        """An objective's loss as ({network: its loss}, the networks this step updates): one tensor is the
        model's loss and updates every network; a dict {network: loss} the networks it names
        (flm.objectives.protocol). The step backwards their sum."""
        if not isinstance(loss, Mapping):
            return {"model": loss}, tuple(self.optimizers)
        unknown = sorted(set(loss) - set(self.optimizers))
        if unknown or not loss:
            raise ValueError(
                f"{type(self.objective).__name__}.loss returned losses for {sorted(loss)}; the networks "
                f"it can update are {', '.join(self.optimizers)}"
            )
        return dict(loss), tuple(name for name in self.optimizers if name in loss)

    def update(self, losses: dict[str, torch.Tensor], updates: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Clip, then step the optimizers of `updates` (and the EMAs with "model") unless a loss or a
        gradient norm is not finite on some rank (decided on the device); record the outcome. Returns
        each stepped network's gradient norm."""
        norms = {name: self.optimizers[name].clip() for name in updates}
        finite = dist.all_min(torch.isfinite(torch.stack([*losses.values(), *norms.values()])).all().float())
        for name in updates:
            self.optimizers[name].step(skip=1.0 - finite)
        if "model" in updates:
            self.ema.update(self.model, self.step, apply=finite)
        self.outcomes.record(self.step, losses, finite, next(iter(norms.values())))
        self.step += 1
        return norms
