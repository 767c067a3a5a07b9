"""Interpolation paths and time samplers shared by the objectives.

A path maps (data x0, noise, time) to a small PathSample: the interpolant x_t and its time
derivative dx_t (the conditional velocity, e.g. the flow-matching target).

- LinearPath (rectified flow; flow matching and MeanFlow): x_t = (1 - t) x0 + t eps, t in [0, 1],
  t = 0 data, t = 1 noise; dx_t = eps - x0. Samplers integrate from t = 1 to t = 0.
- TrigFlowPath (sCM, arXiv 2410.11081 eq. 1): x_t = cos(t) x0 + sin(t) z with z ~ N(0, sigma_d^2 I),
  t in [0, pi/2]; dx_t = cos(t) z - sin(t) x0.
"""

from dataclasses import dataclass

import torch


@dataclass
class PathSample:
    x_t: torch.Tensor  # (B, ...) the interpolant
    dx_t: torch.Tensor  # (B, ...) d x_t / dt, the conditional velocity
    t: torch.Tensor  # (B,)


def bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, ...) to broadcast against `like`."""
    return t.reshape(-1, *([1] * (like.dim() - 1)))


class LinearPath:
    """x_t = (1 - t) x0 + t eps; dx_t = eps - x0."""

    def sample(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> PathSample:
        t_ = bcast(t, x0)
        return PathSample(x_t=(1 - t_) * x0 + t_ * eps, dx_t=eps - x0, t=t)

    def coefficients(self, t: torch.Tensor):
        """(alpha_t, sigma_t, k_t) of x_t = alpha x0 + sigma eps, k = sigma' alpha / sigma - alpha' (flm.objectives.posterior)."""
        t = t.double().clamp_min(1e-12)
        return 1 - t, t, 1 / t


class TrigFlowPath:
    """x_t = cos(t) x0 + sin(t) z, z = sigma_d eps; dx_t = cos(t) z - sin(t) x0."""

    def __init__(self, sigma_d: float):
        self.sigma_d = sigma_d

    def sample(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> PathSample:
        cos_t, sin_t = bcast(torch.cos(t), x0), bcast(torch.sin(t), x0)
        z = self.sigma_d * eps
        return PathSample(x_t=cos_t * x0 + sin_t * z, dx_t=cos_t * z - sin_t * x0, t=t)

    def coefficients(self, t: torch.Tensor):
        """(alpha_t, sigma_t, k_t) of x_t = alpha x0 + sigma eps, k = sigma' alpha / sigma - alpha' (flm.objectives.posterior)."""
        sin_t = torch.sin(t.double()).clamp_min(1e-12)
        return torch.cos(t.double()), self.sigma_d * sin_t, 1 / sin_t


# --------------------------------------------------------------------------------------------
# Time samplers
# --------------------------------------------------------------------------------------------


def logit_normal(n: int, mean: float, std: float, *, device=None) -> torch.Tensor:
    """t = sigmoid(mean + std * N(0, 1)), in (0, 1) (SD3's logit-normal; MeanFlow's default)."""
    return torch.sigmoid(mean + std * torch.randn(n, device=device))


def lognormal_trigflow(n: int, p_mean: float, p_std: float, sigma_d: float, *, device=None) -> torch.Tensor:
    """t = arctan(exp(tau) / sigma_d), tau ~ N(p_mean, p_std^2), in (0, pi/2) (sCM section 4.3)."""
    tau = p_mean + p_std * torch.randn(n, device=device)
    return torch.atan(torch.exp(tau) / sigma_d)


def ramp(step, length: int):
    """min(1, step / length), a warm-up factor; 1 when length is 0. step is an int, or a 0-dim tensor (a CUDA-graph step
    reads it on the GPU, flm.train.graphs)."""
    if length == 0:
        return 1.0
    if isinstance(step, torch.Tensor):
        return (step / length).clamp(max=1.0)
    return min(1.0, step / length)


def randn_per_image(generators, shape, *, device=None) -> torch.Tensor:
    """(len(generators), *shape) N(0, I) noise, image i drawn from generators[i] (CPU generators, so the
    numbers do not depend on the device or on which images share a batch)."""
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)


def time_grid(steps: int, start: float, end: float, *, device=None) -> torch.Tensor:
    """steps + 1 uniformly spaced times from start to end (the samplers' grid)."""
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return torch.linspace(start, end, steps + 1, device=device)
