"""Exponential moving averages of the model weights: one copy per constant decay, and one per power-function
profile (EDM2, Karras et al. 2024: an average whose length grows with training, chosen by its relative width
sigma_rel).

    ema = EMA(model, decays=[0.9999], sigma_rels=[0.05, 0.10])     # keys "0.9999", "sigma_rel0.05", "sigma_rel0.1"
    ema.update(model, step)                                         # after each optimizer step
"""

import copy

import numpy as np
import torch
from torch import nn

from flm.train import checkpoint
from flm.train.parallel import local

POWER_PREFIX = "sigma_rel"


def ema_key(decay: float) -> str:
    return f"{decay:g}"


def power_key(sigma_rel: float) -> str:
    return f"{POWER_PREFIX}{sigma_rel:g}"


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma of the power-function profile whose relative standard deviation is sigma_rel.

    EDM2's relation sigma_rel = (gamma + 1)^(1/2) (gamma + 2)^(-1) (gamma + 3)^(-1/2), squared and multiplied
    out, is the cubic gamma^3 + 7 gamma^2 + (16 - s) gamma + (12 - s) = 0 with s = sigma_rel^-2; gamma is its
    largest real root (the relation is decreasing in gamma, so there is one root above -1)."""
    s = float(sigma_rel) ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    return float(roots[np.abs(roots.imag) < 1e-9].real.max())


def gamma_to_sigma_rel(gamma: float) -> float:
    return float(np.sqrt(gamma + 1) / (gamma + 2) / np.sqrt(gamma + 3))


def power_beta(gamma: float, step: int) -> float:
    """beta(t) = (1 - 1/t)^(gamma + 1) at the t-th update (t = step + 1: the first update copies the weights)."""
    t = step + 1
    return (1.0 - 1.0 / t) ** (gamma + 1.0)


def constant_beta(decay: float, step: int) -> float:
    """min(decay, (1 + s) / (10 + s)) at optimizer step s: short runs and the first steps of long ones are not
    dominated by the random initialisation."""
    return min(decay, (1 + step) / (10 + step))


class EMA:
    """Averages of `model`'s parameters for each decay in `decays` and each width in `sigma_rels` (buffers are
    copied as they are). Both lists may be empty: a run without EMA (grids then use the raw weights).

    wrap places each copy like the trained model (flm.train.parallel.wrap_copy: sharded alike under
    FSDP2, so the average is taken shard by shard). state_dict() gathers whole tensors and must be
    called on every rank; load_state_dict() takes whole tensors, before or after wrapping.
    """

    def __init__(self, model: nn.Module, decays, wrap=lambda m: m, sigma_rels=()):
        decays, sigma_rels = [float(d) for d in decays], [float(s) for s in sigma_rels]
        if not all(0 <= d < 1 for d in decays):
            raise ValueError(f"trainer.ema_decays must be a list of numbers in [0, 1), got {decays}")
        # sigma_rel -> 0 is gamma -> inf; gamma = 0 (a uniform average of the whole run) is the widest kept here
        if not all(0 < s < gamma_to_sigma_rel(0.0) for s in sigma_rels):
            raise ValueError(
                f"trainer.ema_sigma_rels must be a list of numbers in (0, 0.288), e.g. [0.05, 0.1], got {sigma_rels}"
            )
        gammas = {power_key(s): sigma_rel_to_gamma(s) for s in sigma_rels}
        self.betas = {ema_key(d): lambda step, d=d: constant_beta(d, step) for d in decays}
        self.betas |= {key: lambda step, g=g: power_beta(g, step) for key, g in gammas.items()}
        self.models = {key: wrap(self._copy(model)) for key in self.betas}

    @staticmethod
    def _copy(model: nn.Module) -> nn.Module:
        ema = copy.deepcopy(model).eval()
        ema.requires_grad_(False)
        return ema

    @property
    def default(self) -> nn.Module | None:
        """The first average's model: the one sample grids use (None: the run keeps no EMA)."""
        return next(iter(self.models.values()), None)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int, apply: torch.Tensor | None = None) -> None:
        """One averaging step; where `apply` (a 0-dim 0/1 tensor, read on the device) is 0 the averages
        stay as they are (a skipped optimizer step)."""
        src = [local(p.detach()) for p in model.parameters()]
        for key, ema in self.models.items():
            if hasattr(ema, "reshard"):  # FSDP2 leaves a root's parameters gathered after a forward (a target network's)
                ema.reshard()
            weight = 1.0 - self.betas[key](step)
            params = [local(p) for p in ema.parameters()]
            if apply is None:
                torch._foreach_lerp_(params, src, weight)
            else:  # one weight tensor per parameter: a tensor weight in place of a number needs no host sync
                torch._foreach_lerp_(params, src, [apply * weight] * len(params))
            for b_ema, b in zip(ema.buffers(), model.buffers()):
                b_ema.copy_(b)

    def state_dict(self) -> dict:
        return {key: checkpoint.model_state(ema) for key, ema in self.models.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.models):
            raise ValueError(
                f"the checkpoint has EMAs {sorted(state)} but trainer.ema_decays and trainer.ema_sigma_rels give "
                f"{sorted(self.models)}; pass the values the run was started with"
            )
        for key, ema in self.models.items():
            checkpoint.load_model_state(ema, state[key])
