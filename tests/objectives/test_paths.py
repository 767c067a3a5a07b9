"""Paths and time samplers.

python -m pytest tests/objectives/test_paths.py -q
"""

import math

import pytest
import torch

from flm.objectives.paths import (
    LinearPath,
    TrigFlowPath,
    batch_velocity,
    check_velocity_estimate,
    logit_normal,
    lognormal_trigflow,
)


def _dxdt(path, x0, eps, t):
    return torch.func.jvp(lambda t_: path.sample(x0, eps, t_).x_t, (t,), (torch.ones_like(t),))[1]


def test_dx_t_is_the_time_derivative():
    x0, eps, t = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3), torch.rand(4)
    for path in (LinearPath(), TrigFlowPath(sigma_d=0.7)):
        torch.testing.assert_close(path.sample(x0, eps, t).dx_t, _dxdt(path, x0, eps, t))


def test_endpoints():
    x0, eps = torch.randn(2, 3), torch.randn(2, 3)
    lin = LinearPath()
    torch.testing.assert_close(lin.sample(x0, eps, torch.zeros(2)).x_t, x0)
    torch.testing.assert_close(lin.sample(x0, eps, torch.ones(2)).x_t, eps)
    trig = TrigFlowPath(sigma_d=0.5)
    torch.testing.assert_close(trig.sample(x0, eps, torch.full((2,), math.pi / 2)).x_t, 0.5 * eps)


def test_time_samplers():
    torch.manual_seed(0)
    t = logit_normal(20000, -0.4, 1.0)
    assert t.min() > 0 and t.max() < 1
    torch.testing.assert_close(torch.logit(t).mean(), torch.tensor(-0.4), atol=0.03, rtol=0)
    t = lognormal_trigflow(20000, -1.0, 1.4, 0.5)
    assert t.min() > 0 and t.max() < math.pi / 2
    torch.testing.assert_close(torch.log(0.5 * torch.tan(t)).std(), torch.tensor(1.4), atol=0.03, rtol=0)


def _posterior_velocity(path, x0, x_t, t, y_in=None, y=None, null=None):
    """E[dx_t/dt | x_t] over the batch's images, one sample at a time: each image's likelihood, then the average of
    the velocity that image implies (alpha' x0_j + sigma' eps_j), by autograd's time derivative of the coefficients."""
    out = []
    for i in range(len(x_t)):
        ti = t[i].double().requires_grad_(True)
        alpha, sigma, _ = path.coefficients(ti[None])
        d_alpha, d_sigma = (torch.autograd.grad(c.sum(), ti, retain_graph=True)[0] for c in (alpha, sigma))
        alpha, sigma = alpha.detach(), sigma.detach()
        keep = [j for j in range(len(x0)) if y_in is None or y_in[i] == null or y[j] == y_in[i]]
        refs = x0[keep].double()
        eps = (x_t[i].double() - alpha * refs) / sigma
        log_w = torch.stack([torch.distributions.Normal(0.0, 1.0).log_prob(e).sum() for e in eps])
        w = torch.softmax(log_w, 0)
        velocities = d_alpha * refs + d_sigma * eps
        out.append((w.view(-1, *[1] * (refs.dim() - 1)) * velocities).sum(0))
    return torch.stack(out).float()


@pytest.mark.parametrize("path", [LinearPath(), TrigFlowPath(sigma_d=0.5)], ids=["linear", "trigflow"])
def test_batch_velocity_is_the_posterior_mean_over_the_batch(path):
    torch.manual_seed(0)
    x0 = torch.randn(6, 2, 2, 2) * 0.5
    t = torch.tensor([0.3, 0.5, 0.7, 0.9, 0.95, 0.6]) * (1 if isinstance(path, LinearPath) else math.pi / 2)
    s = path.sample(x0, torch.randn_like(x0), t)
    torch.testing.assert_close(batch_velocity(path, x0, s), _posterior_velocity(path, x0, s.x_t, t), atol=1e-5, rtol=1e-5)
    # with labels: a class label's posterior is over its class's images; the null class (3) sees them all
    y = torch.tensor([0, 1, 0, 1, 2, 2])
    y_in = torch.tensor([0, 3, 0, 1, 3, 2])
    got = batch_velocity(path, x0, s, y_in, y, 3)
    torch.testing.assert_close(got, _posterior_velocity(path, x0, s.x_t, t, y_in, y, 3), atol=1e-5, rtol=1e-5)


def test_batch_velocity_at_the_ends_of_the_path():
    torch.manual_seed(0)
    path, x0 = LinearPath(), torch.randn(5, 3)
    # near the data the sample's own image is the only plausible one: the conditional velocity, to the bit
    s = path.sample(x0, torch.randn_like(x0), torch.full((5,), 1e-3))
    assert torch.equal(batch_velocity(path, x0, s), s.dx_t)
    # at pure noise every image is as likely: x_t minus the batch's mean image
    s = path.sample(x0, torch.randn_like(x0), torch.ones(5))
    torch.testing.assert_close(batch_velocity(path, x0, s), s.x_t - x0.mean(0))
    # a batch of one image repeated has nothing to average: the conditional velocity at every t
    same = x0[:1].expand(5, 3)
    s = path.sample(same, torch.randn_like(same), torch.rand(5))
    torch.testing.assert_close(batch_velocity(path, same, s), s.dx_t)


def test_velocity_estimate_is_checked():
    with pytest.raises(ValueError, match="velocity_estimate 'posterior'.*sample, batch"):
        check_velocity_estimate("posterior")
