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
        """(alpha_t, sigma_t, k_t) of x_t = alpha x0 + sigma eps, k = sigma' alpha / sigma - alpha' (batch_velocity)."""
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
        """(alpha_t, sigma_t, k_t) of x_t = alpha x0 + sigma eps, k = sigma' alpha / sigma - alpha' (batch_velocity)."""
        sin_t = torch.sin(t.double()).clamp_min(1e-12)
        return torch.cos(t.double()), self.sigma_d * sin_t, 1 / sin_t


VELOCITY_ESTIMATES = ("sample", "batch")


def check_velocity_estimate(value: str) -> str:
    if value not in VELOCITY_ESTIMATES:
        raise ValueError(f"unknown velocity_estimate {value!r}; valid: {', '.join(VELOCITY_ESTIMATES)}")
    return value


def batch_velocity(path, x0: torch.Tensor, s: PathSample, y_in=None, y=None, null: int | None = None) -> torch.Tensor:
    """The batch's estimate of the marginal velocity E[dx_t/dt | x_t] (a stable target field), in place of dx_t.

    On a path x_t = alpha_t x0 + sigma_t n, each x_t is scored against every image x0_j of the batch as its clean image
    (batch_posterior), E[x0 | x_t] ~ x^_i = sum_j w_ij x0_j, and as the velocity is linear in x0 at fixed x_t,
    v_i = dx_t_i + k_i (x0_i - x^_i) with k = sigma' alpha / sigma - alpha' (1 / t on the linear path, 1 / sin t on
    TrigFlow). Where the sample's own image dominates (small t) this is the conditional velocity; near noise, where that
    is noisiest, it is the velocity of the batch's mixture (on MNIST: 7-30x closer to the training set's exact marginal
    velocity at t >= 0.9, benchmarks/velocity_variance.py). y_in / y / null: the labels after and before label dropout
    and the null class; a sample with a class label is scored against that class's images alone."""
    k = path.coefficients(s.t)[2].double()[:, None]
    x = x0.flatten(1).double()
    x_hat = batch_posterior(path, x0, s, y_in, y, null) @ x
    shift = k * (x - x_hat)  # no cancellation at small t: x - x^ -> 0 as fast as k grows
    return s.dx_t + shift.to(s.dx_t.dtype).view_as(s.dx_t)


def batch_posterior(path, x0: torch.Tensor, s: PathSample, y_in=None, y=None, null: int | None = None) -> torch.Tensor:
    """(B, B) weights w_ij = softmax_j(-||x_t_i - alpha_i x0_j||^2 / (2 sigma_i^2)): how likely each batch image is as
    x_t_i's clean image (batch_velocity's arguments). Distances in float64: the expansion ||a||^2 - 2 a.b + ||b||^2 is
    exact enough there, and one (B, B) matmul is cheap."""
    alpha, sigma, _ = (c.double()[:, None] for c in path.coefficients(s.t))
    z, x = s.x_t.flatten(1).double(), x0.flatten(1).double()
    dist = z.square().sum(1, keepdim=True) - 2 * alpha * (z @ x.T) + alpha.square() * x.square().sum(1)[None, :]
    logits = -dist / (2 * sigma.square().clamp_min(1e-12))
    if y_in is not None:  # a dropped label sees every image; the sample's own image is always of its class
        same = (y_in[:, None] == y[None, :]) | (y_in == null)[:, None]
        logits = logits.masked_fill(~same, -torch.inf)
    return torch.softmax(logits, dim=1)


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
