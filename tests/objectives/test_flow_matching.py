"""Flow matching: samplers on a closed-form flow, the loss at the exact velocity, guidance.

python -m pytest tests/objectives/test_flow_matching.py -q
"""

import pytest
import torch

from flm.objectives import FlowMatching
from tests.objectives.toys import GaussianVelocity, LabelVelocity, PointMassVelocity

MU, S = 1.5, 0.5


def _error(sampler, steps):
    noise = torch.randn(256, 1, 2, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = FlowMatching(sampler=sampler).sample(GaussianVelocity(MU, S), noise, steps=steps)
    return (x - (MU + S * noise)).abs().max().item()


def test_samplers_reach_the_known_endpoint():
    euler = [_error("euler", n) for n in (5, 20, 80)]
    heun = [_error("heun", n) for n in (5, 20)]
    assert euler[0] > euler[1] > euler[2] and euler[2] < 0.04  # first order: ~4x per 4x steps
    assert 2.5 < euler[1] / euler[2] < 6
    assert heun[0] < euler[0] / 5 and heun[1] < euler[1] / 20  # second order


def test_loss_is_zero_at_the_exact_velocity_only():
    x = torch.full((64, 1, 2, 2), 0.7)
    torch.manual_seed(0)
    exact, _ = FlowMatching().loss(PointMassVelocity(a=0.7), x)
    off, _ = FlowMatching().loss(PointMassVelocity(a=0.7, offset=0.3), x)
    assert exact < 1e-8
    torch.testing.assert_close(off, torch.tensor(0.09), rtol=1e-4, atol=0)


def test_classifier_free_guidance_combines_cond_and_null():
    noise = torch.zeros(2, 1, 2, 2)
    y = torch.tensor([0, 2])
    x = FlowMatching().sample(LabelVelocity(), noise, y, steps=1, cfg_scale=2.5)
    # one Euler step from t=1 to 0: x = -(null + 2.5 (cond - null)), null velocity 0, cond y + 1
    torch.testing.assert_close(x[:, 0, 0, 0], -2.5 * torch.tensor([1.0, 3.0]))


def test_loss_t_min_caps_the_weight_of_small_t():
    """An offset of 0.3 in the velocity costs 0.09 at every t >= loss_t_min and 0.09 (t / loss_t_min)^2 below it."""
    x = torch.full((4096, 1, 2, 2), 0.7)
    torch.manual_seed(0)
    t = torch.sigmoid(torch.randn(4096))  # the draw FlowMatching().loss makes after the same seed
    torch.manual_seed(0)
    capped, _ = FlowMatching(loss_t_min=0.5).loss(PointMassVelocity(a=0.7, offset=0.3), x)
    torch.testing.assert_close(capped, 0.09 * (t / 0.5).clamp_max(1).square().mean(), rtol=1e-4, atol=0)
    assert capped < 0.09 * 0.8  # a quarter of logit-normal(0, 1)'s t lie below 0.5
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="loss_t_min must be in"):
            FlowMatching(loss_t_min=bad)
