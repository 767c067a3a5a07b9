"""Exponential moving averages of the model weights, one copy per decay rate."""

import copy

import torch
from torch import nn

from flm.train import checkpoint
from flm.train.parallel import local


def ema_key(decay: float) -> str:
    return f"{decay:g}"


class EMA:
    """Averages of `model`'s parameters for each decay in `decays` (buffers are copied as they are).

    The effective decay at optimizer step s is min(decay, (1 + s) / (10 + s)), so short runs and the
    first steps of long ones are not dominated by the random initialisation.

    wrap places each copy like the trained model (flm.train.parallel.wrap_copy: sharded alike under
    FSDP2, so the average is taken shard by shard). state_dict() gathers whole tensors and must be
    called on every rank; load_state_dict() takes whole tensors, before or after wrapping.
    """

    def __init__(self, model: nn.Module, decays, wrap=lambda m: m):
        decays = [float(d) for d in decays]
        if not decays or not all(0 <= d < 1 for d in decays):
            raise ValueError(f"trainer.ema_decays must be a non-empty list of numbers in [0, 1), got {decays}")
        self.models = {ema_key(d): wrap(self._copy(model)) for d in decays}
        self.decays = {ema_key(d): d for d in decays}

    @staticmethod
    def _copy(model: nn.Module) -> nn.Module:
        ema = copy.deepcopy(model).eval()
        ema.requires_grad_(False)
        return ema

    @property
    def default(self) -> nn.Module:
        """The first decay's model: the one sample grids use."""
        return next(iter(self.models.values()))

    @torch.no_grad()
    def update(self, model: nn.Module, step: int, apply: torch.Tensor | None = None) -> None:
        """One averaging step; where `apply` (a 0-dim 0/1 tensor, read on the device) is 0 the averages
        stay as they are (a skipped optimizer step)."""
        src = [local(p.detach()) for p in model.parameters()]
        for key, ema in self.models.items():
            decay = min(self.decays[key], (1 + step) / (10 + step))
            params = [local(p) for p in ema.parameters()]
            if apply is None:
                torch._foreach_lerp_(params, src, 1.0 - decay)
            else:  # one weight tensor per parameter: a tensor weight in place of a number needs no host sync
                torch._foreach_lerp_(params, src, [apply * (1.0 - decay)] * len(params))
            for b_ema, b in zip(ema.buffers(), model.buffers()):
                b_ema.copy_(b)

    def state_dict(self) -> dict:
        return {key: checkpoint.model_state(ema) for key, ema in self.models.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.models):
            raise ValueError(
                f"the checkpoint has EMA decays {sorted(state)} but trainer.ema_decays gives {sorted(self.models)}; "
                f"pass the decays the run was started with"
            )
        for key, ema in self.models.items():
            checkpoint.load_model_state(ema, state[key])
