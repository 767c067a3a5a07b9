"""What the training loop, sample.py and evaluate.py rely on in an objective (flm.objectives.Objective),
and how an objective declares the networks it needs besides the model it trains (Network).

A distillation objective, say, declares a frozen teacher that the student starts from, and a
trainable fake-score network (flm.objectives.distillation.RCM is this):

    class Distill(nn.Module):
        time_inputs, sample_steps, predictions = 1, 1, ("velocity",)

        def __init__(self, teacher: str, fake_lr: float = 1e-5):
            super().__init__()
            self.networks = {
                "teacher": Network(build=partial(load_teacher, teacher), model_init=True),
                "fake_score": Network(build=partial(load_teacher, teacher), trainable=True, optim={"lr": fake_lr}),
            }

        def phase(self, step: int) -> str:
            return "fake_score" if step % 2 == 0 else "model"

        def loss(self, model, x, y=None, *, step=0, phase=None, teacher, fake_score):
            if (phase or self.phase(step)) == "fake_score":
                return {"fake_score": ...}, metrics  # this step updates the fake score only
            return {"model": ...}, metrics           # and this one the model (and its EMA) only

The loop builds each declared network from the trained model's build arguments, places it on the
device, and passes it to every `loss` call as the keyword of its name. A trainable one is wrapped
like the model (DDP / FSDP2), gets its own AdamW (optim.* with `optim` over it) and schedule, is
clipped, skipped on a non-finite step and saved in the checkpoint under its name (flm.train.state); a
frozen one gets no gradients, is not saved and is built again on resume. With `model_init` the trained
model (and its EMAs) start from that network's weights: every tensor they share by name (a MeanFlow
student keeps the initialisation of its second time embedding, which a flow-matching teacher lacks).

Alternating updates: `loss` returns one loss, whose gradients every optimizer steps with, or a dict
{network: loss} of the networks this step updates ("model" for the trained model, else a trainable
network's name); the others' optimizers, and the model's EMA unless "model" is there, skip the step.
The choice must depend on the step alone (every micro-batch and rank of a step makes the same one),
which also makes a resumed run alternate as the whole run did. An objective that alternates, or whose
steps otherwise compute different things (MeanFlow's consistency curriculum), says so with
`phase(step) -> str | None`, the name of the step's kind (None: one kind), which the loop passes to `loss`
as `phase=` (step is then a device tensor under CUDA graphs, where the loop captures one graph per phase);
without it, trainer.cuda_graph=true refuses an objective whose loss does not update every network.
"""

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class Network:
    """A network an objective uses besides the trained model.

    build: model_args (flm.models.build_model's keywords for the trained model) -> the network, its
    weights set (a teacher's loaded from its checkpoint). trainable: False for a frozen network, True
    for one with its own optimizer. optim: flm.train.OptimConfig fields that differ from the run's for
    that optimizer, e.g. {"lr": 1e-5}. model_init: the trained model starts from this network's
    weights (at most one network of an objective sets it). bf16_on_cuda: a frozen network that runs only under bf16
    autocast on CUDA (a teacher: flm.objectives.teacher.teacher_velocity and teacher_features); the loop then stores
    its linear layers' weights in bf16 once, on a GPU where they are whole (flm.objectives.teacher.matmuls_in_bf16).
    """

    build: Callable[[dict], nn.Module]
    trainable: bool = False
    optim: Mapping[str, Any] = field(default_factory=dict)
    model_init: bool = False
    bf16_on_cuda: bool = False


NO_NETWORKS: Mapping[str, Network] = MappingProxyType({})


class Objective(Protocol):
    """An objective owns its loss and its sampler (flm.objectives' objectives are nn.Modules; their
    parameters, such as sCM's adaptive weighting, train with the model, their state_dict goes into
    the checkpoint)."""

    time_inputs: int  # the model's time inputs: 1 (t) or 2 (t, r: MeanFlow)
    sample_steps: int  # the sampler's default step count (grids, sample.py, evaluate.py)
    networks: Mapping[str, Network]  # the networks it needs besides the model; NO_NETWORKS for none
    predictions: tuple[str, ...]  # the model outputs (flm.models.PREDICTIONS) its loss and sampler read; the first is
    # model.prediction=auto's
    # optional: velocity_head (bool), whether the model needs its velocity head (flm.models.dit; sCM's velocity_weight)

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None, *, step=0, **networks: nn.Module
    ) -> tuple[torch.Tensor | Mapping[str, torch.Tensor], dict]:
        """(loss, metrics); loss: one tensor, or {network: loss} for the networks this step updates (the
        module docstring); step is an int, or a 0-dim device tensor when the step is a CUDA graph."""

    def sample(
        self,
        model: nn.Module,
        noise: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        steps: int,
        cfg_scale: float = 1.0,
        generators=None,
    ) -> torch.Tensor:
        """Images from `noise`; `generators` (one per image) feed any noise drawn after it."""

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict): ...

    def to(self, device): ...
