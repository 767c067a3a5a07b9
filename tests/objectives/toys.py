"""Closed-form "models" for the objectives' analytic tests (signature model(x, t, r=None, y=None)).

Data is a point mass at `a` (or a Gaussian N(mu, s^2) per element for flow matching), so the exact
velocity, average velocity and consistency function are known. `offset` moves a model away from the
exact solution (and gives it a parameter to differentiate).
"""

import torch
from torch import nn

from flm.models.dit import velocity_from_data


def _b(t, x):
    return t.reshape(-1, *([1] * (x.dim() - 1)))


class Toy(nn.Module):
    num_classes = 0

    def __init__(self, a: float = 0.0, offset: float = 0.0):
        super().__init__()
        self.a = a
        self.offset = nn.Parameter(torch.tensor(float(offset)))


class PointMassVelocity(Toy):
    """Flow matching, x_t = (1 - t) a + t eps: v(z, t) = (z - a) / t."""

    def forward(self, x, t, r=None, y=None):
        return (x - self.a) / _b(t, x) + self.offset


class GaussianVelocity(nn.Module):
    """Flow matching from N(0, 1) (t = 1) to N(mu, s^2) (t = 0): the marginal velocity field.

    x_t ~ N((1 - t) mu, sigma_t^2), sigma_t^2 = (1 - t)^2 s^2 + t^2; the flow keeps
    (x - m_t) / sigma_t fixed, so noise n ends at mu + s n.
    """

    num_classes = 0

    def __init__(self, mu: float, s: float):
        super().__init__()
        self.mu, self.s = mu, s

    def forward(self, x, t, r=None, y=None):
        t = _b(t, x)
        var = (1 - t) ** 2 * self.s**2 + t**2
        return -self.mu + (t - (1 - t) * self.s**2) / var * (x - (1 - t) * self.mu)


class PointMassMeanFlow(Toy):
    """MeanFlow: trajectories are straight, u(z, r, t) = (z_t - z_r) / (t - r) = (z - a) / t.

    With offset c, u = (z - a) / t + c t: du/dt = c and u - u_tgt = c (2 t - r) in closed form.
    """

    def forward(self, x, t, r=None, y=None):
        return (x - self.a) / _b(t, x) + self.offset * _b(t, x)


class PointMassTrigFlow(Toy):
    """sCM: F(x / sigma_d, t) such that f(x_t, t) = cos t x_t - sin t sigma_d F = a for every t."""

    def __init__(self, a: float = 0.0, offset: float = 0.0, sigma_d: float = 0.5):
        super().__init__(a, offset)
        self.sigma_d = sigma_d

    def forward(self, x, t, r=None, y=None):
        t = _b(t, x)
        return (torch.cos(t) * self.sigma_d * x - self.a) / (self.sigma_d * torch.sin(t)) + self.offset * t


class LabelVelocity(nn.Module):
    """A conditional toy: velocity = the label's value (null class: 0); checks guidance arithmetic."""

    num_classes = 3

    def forward(self, x, t, r=None, y=None):
        value = torch.where(y == self.num_classes, torch.zeros_like(y), y + 1).float()
        return torch.ones_like(x) * _b(value, x)


class PointMassData(Toy):
    """A data-predicting model (DiT's model.prediction=data) whose clean image is the point mass a (in x / sigma_d's
    units, a / sigma_d), returned as the DiT returns it: the linear path's velocity at its input."""

    prediction = "data"

    def __init__(self, a: float = 0.0, offset: float = 0.0, sigma_d: float = 0.5):
        super().__init__(a, offset)
        self.sigma_d = sigma_d

    def forward(self, x, t, r=None, y=None):
        x_hat = torch.full_like(x, self.a / self.sigma_d) + self.offset * _b(t, x)
        return velocity_from_data(x, x_hat, t)
