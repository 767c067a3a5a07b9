"""Paths and time samplers.

python -m pytest tests/objectives/test_paths.py -q
"""

import math

import torch

from flm.objectives.paths import LinearPath, TrigFlowPath, logit_normal, lognormal_trigflow


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
