"""objective.velocity_estimate=batch: the batch's posterior mean of the data's velocity (flm.objectives.paths).

Data of two images, +a and -a (every pixel), has a closed-form marginal velocity; a batch that holds both equally
often is that distribution exactly, so the batch estimate IS the marginal velocity and each objective's loss vanishes
at the exact field, where the conditional velocity's noise keeps it away from zero.

python -m pytest tests/objectives/test_velocity_estimate.py -q
"""

import math

import pytest
import torch
from torch import nn

from flm.objectives import SCD, SCM, FlowMatching, MeanFlow, build_objective

A = 0.8


def _b(t, x):
    return t.reshape(-1, *([1] * (x.dim() - 1)))


def _posterior_mean(x_t, alpha, sigma):
    """E[x0 | x_t] for x0 = +-A (equally likely, every pixel alike), x_t = alpha x0 + sigma n."""
    alpha, sigma = alpha.flatten(), sigma.flatten()  # (B,)
    logit = 2 * A * alpha * x_t.flatten(1).sum(1) / sigma.square()  # log p(+A | x_t) - log p(-A | x_t)
    return _b(A * torch.tanh(logit / 2), x_t)


class TwoImageVelocity(nn.Module):
    """The exact marginal velocity on the linear path, (z - E[x0 | z]) / t; MeanFlow's u(z, t, t) alike."""

    num_classes = 0

    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(()))  # something to differentiate

    def forward(self, x, t, r=None, y=None):
        tb = _b(t, x)
        return (x - _posterior_mean(x, 1 - tb, tb)) / tb + self.offset


class TwoImageTrigFlow(TwoImageVelocity):
    """sCM's F = (dx_t/dt) / sigma_d of the marginal TrigFlow flow at x_in = x_t / sigma_d: (cos t x_t - x^) / sin t."""

    sigma_d = 0.5

    def forward(self, x, t, r=None, y=None):
        x_t, cos_t, sin_t = self.sigma_d * x, _b(torch.cos(t), x), _b(torch.sin(t), x)
        x_hat = _posterior_mean(x_t, cos_t, self.sigma_d * sin_t)
        return (cos_t * x_t - x_hat) / sin_t / self.sigma_d + self.offset


def _two_images(n=64):
    return torch.cat([torch.full((n // 2, 1, 2, 2), A), torch.full((n // 2, 1, 2, 2), -A)])


@pytest.mark.parametrize(
    "make",
    [
        lambda estimate: FlowMatching(velocity_estimate=estimate, label_dropout=0.0),
        # every sample at r = t: u(z, t, t) regresses on v itself
        lambda estimate: MeanFlow(velocity_estimate=estimate, r_neq_t=0.0, jvp_subset=True, adaptive_p=0.0),
    ],
    ids=["flow_matching", "meanflow"],
)
def test_the_loss_vanishes_at_the_marginal_velocity_with_the_batch_estimate(make):
    x, model = _two_images(), TwoImageVelocity().double()
    torch.manual_seed(0)
    batch, _ = make("batch").loss(model, x.double())
    torch.manual_seed(0)
    sample, _ = make("sample").loss(model, x.double())
    assert batch.item() < 1e-12
    assert sample.item() > 0.1  # eps - x0 scatters around the marginal velocity


def test_scm_tangent_vanishes_at_the_marginal_velocity_with_the_batch_estimate():
    """Before the tangent warm-up g = -cos^2 t (sigma_d F - dx_t/dt): zero at the exact F for the batch estimate."""
    x, model = _two_images(), TwoImageTrigFlow().double()
    for estimate, check in (("batch", lambda m: m < 1e-9), ("sample", lambda m: m > 1e-3)):
        scm = SCM(velocity_estimate=estimate, warmup_steps=10, label_dropout=0.0).double()
        torch.manual_seed(0)
        _, metrics = scm.loss(model, x.double(), step=0)
        assert check(metrics["mse"].item()), (estimate, metrics["mse"].item())


def test_velocity_estimate_options():
    for name in ("flow_matching", "meanflow", "scm"):
        assert build_objective(name, velocity_estimate="batch").velocity_estimate == "batch"
        with pytest.raises(ValueError, match="unknown velocity_estimate 'exact'"):
            build_objective(name, velocity_estimate="exact")
    # a teacher's velocity replaces the data's: nothing to estimate
    with pytest.raises(ValueError, match="velocity_estimate=batch .* objective.velocity_estimate=sample"):
        MeanFlow(velocity_estimate="batch", teacher="run")
    with pytest.raises(ValueError, match="sCD takes the teacher's: set objective.velocity_estimate=sample"):
        SCD(teacher="run", velocity_estimate="batch")
    assert math.isclose(TwoImageTrigFlow.sigma_d, SCM().sigma_d)
