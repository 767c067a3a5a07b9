"""objective.velocity_estimate=batch: the data's velocity as its posterior mean over the batch (flm.objectives.posterior).

Data of two images, +a and -a (every pixel), has a closed-form marginal velocity; a batch that holds both equally
often is that distribution exactly, so the batch estimate IS the marginal velocity and each objective's loss vanishes
at the exact field, where the conditional velocity's noise keeps it away from zero.

python -m pytest tests/objectives/test_posterior.py -q
"""

import math

import pytest
import torch
from torch import nn

from flm.objectives import SCD, SCM, FlowMatching, MeanFlow, build_objective
from flm.objectives.paths import LinearPath, TrigFlowPath
from flm.objectives.posterior import ReferenceBank, batch_velocity, check_velocity_estimate

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


def test_the_bank_reads_earlier_steps_blocks_and_a_step_reads_the_same_however_often_it_runs():
    bank = ReferenceBank(8)  # two blocks of a batch of 4 to read, a third for the step's own write
    x = [torch.randn(4, 1, 2, 2) for _ in range(4)]
    y = torch.arange(4)
    images, labels, valid = bank.references(x[0], y, 0)
    assert images.shape == (16, 1, 2, 2) and valid.tolist() == [True] * 4 + [False] * 12
    # the same step again (a CUDA graph's warm-up, a second micro-batch): it reads what it read, writes its own block
    again = bank.references(x[0], y, 0)
    assert torch.equal(again[2], valid) and torch.equal(again[0][:4], images[:4])
    images, labels, valid = bank.references(x[1], y + 4, 1)
    assert valid.tolist() == [True] * 8 + [False] * 8 and torch.equal(images[4:8], x[0])
    bank.references(x[2], y, 2)
    images, labels, valid = bank.references(x[3], y, 3)  # block 0 is step 3's to write: steps 1 and 2 are read
    assert valid.tolist() == [True] * 4 + [False] * 4 + [True] * 8
    assert torch.equal(images[8:12], x[1]) and labels[8:12].tolist() == [4, 5, 6, 7]
    images, labels, valid = bank.references(x[0], y, None)  # no step: every written block, nothing written
    assert valid.all() and torch.equal(images[4:8], x[3])
    assert torch.equal(bank.references(x[0], y, None)[0], images)
    with pytest.raises(ValueError, match="needs the run's fixed batch size"):
        bank.references(torch.randn(2, 1, 2, 2), y[:2], 4)


@pytest.mark.parametrize("path", [LinearPath(), TrigFlowPath(sigma_d=0.5)], ids=["linear", "trigflow"])
def test_batch_velocity_over_references_is_the_posterior_over_the_valid_ones(path):
    torch.manual_seed(0)
    x0, extra = torch.randn(4, 1, 2, 2) * 0.5, torch.randn(6, 1, 2, 2) * 0.5
    t = torch.tensor([0.5, 0.8, 0.9, 0.95]) * (1 if isinstance(path, LinearPath) else math.pi / 2)
    s = path.sample(x0, torch.randn_like(x0), t)
    valid = torch.tensor([True] * 4 + [True, False, True, True, False, True])
    references = (torch.cat([x0, extra]), torch.zeros(10, dtype=torch.long), valid)
    got = batch_velocity(path, x0, s, references=references)
    want = _posterior_velocity(path, references[0][valid], s.x_t, t)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_objective_with_a_bank_resumes_from_its_state_bit_for_bit():
    from tests.objectives.toys import GaussianVelocity

    model = GaussianVelocity(1.5, 0.5)
    make = lambda: MeanFlow(velocity_estimate="batch", velocity_references=32, adaptive_p=0.0)  # noqa: E731
    x = [torch.randn(16, 1, 2, 2) for _ in range(4)]
    run = make()
    for step in range(3):
        run.loss(model, x[step], step=step)
    resumed = make()
    assert resumed.state_dict()["data_velocity.bank.images"].numel() == 0  # allocated at the first batch
    resumed.load_state_dict(run.state_dict())
    torch.manual_seed(1)
    a = run.loss(model, x[3], step=3)[0]
    torch.manual_seed(1)
    b = resumed.loss(model, x[3], step=3)[0]
    assert torch.equal(a, b) and all(torch.equal(v, resumed.state_dict()[k]) for k, v in run.state_dict().items())
    assert set(run.state_dict()) == {"data_velocity.bank.images", "data_velocity.bank.labels", "data_velocity.bank.written"}
    assert not MeanFlow().state_dict() and not any("bank" in k for k in SCM().state_dict())  # old checkpoints load


def test_velocity_references_options():
    with pytest.raises(ValueError, match="set objective.velocity_estimate=batch or objective.velocity_references=0"):
        FlowMatching(velocity_references=64)
    with pytest.raises(ValueError, match="velocity_references must be a number of images >= 0"):
        check_velocity_estimate("batch", -1)
    with pytest.raises(ValueError, match="sCD takes the teacher's"):
        SCD(teacher="run", velocity_references=64)
