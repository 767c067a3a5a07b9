"""sCT on TrigFlow: loss at the exact consistency function, warm-up, adaptive weighting, sampler.

python -m pytest tests/objectives/test_consistency.py -q
"""

import math

import pytest
import torch

from flm.objectives import SCM
from tests.models.tiny import tiny_dit
from flm.objectives.consistency import SIN_MIN
from tests.objectives.curriculum import gradient_distances
from tests.objectives.toys import LabelVelocity, PointMassData, PointMassTrigFlow

A = 0.7


def _data(n=64):
    return torch.full((n, 1, 2, 2), A)


@pytest.mark.parametrize("jvp_mode", ["dual", "two_pass", "func"])
@pytest.mark.parametrize("step", [0, 10])
def test_loss_is_zero_at_the_exact_consistency_function(jvp_mode, step):
    # df/dt = 0 along the flow: both terms of g vanish only with the right JVP tangents
    torch.manual_seed(0)
    loss, metrics = SCM(warmup_steps=10, jvp_mode=jvp_mode).loss(PointMassTrigFlow(A), _data(), step=step)
    assert metrics["tangent_norm"] < 1e-4 and loss.abs() < 1e-9


def test_loss_away_from_the_solution_and_warmup():
    model = PointMassTrigFlow(A, offset=0.3)
    objective = SCM(warmup_steps=10)
    losses = []
    for step in (0, 5, 10, 20):
        torch.manual_seed(1)
        losses.append(objective.loss(model, _data(), step=step)[1]["tangent_norm"])
    assert losses[0] > 1e-2
    assert losses[0] != losses[1] != losses[2]  # warm-up scales the dF/dt term in
    torch.testing.assert_close(losses[2], losses[3])  # and stops at warmup_steps


def test_normalised_tangent_and_adaptive_weighting():
    """At F = F-, the loss is exp(-logvar) ||g / (||g|| + c)||^2 / D + logvar; logvar learns."""
    objective = SCM(warmup_steps=0)
    torch.manual_seed(2)
    loss, metrics = objective.loss(PointMassTrigFlow(A, offset=0.3), _data(8))
    norm = metrics["tangent_norm"]
    assert metrics["mse"] < 1 / 4  # ||g_normalised||^2 / D < 1 / D
    loss.backward()
    grad = objective.logvar.linear.bias.grad
    torch.testing.assert_close(grad, 1 - metrics["mse"].reshape(1), rtol=1e-5, atol=0)  # d/dlogvar at 0
    assert norm > 0


def test_logvar_loss_sum_weighs_the_squared_norm():
    """logvar_loss="sum": the head weighs ||.||^2 = D x the mean's loss, at most 1 for the normalised tangent where the
    zero-initialised head starts (sCD's default); an unknown name is refused."""
    torch.manual_seed(2)
    loss, metrics = SCM(warmup_steps=0, logvar_loss="sum").loss(PointMassTrigFlow(A, offset=0.3), _data(8))
    torch.testing.assert_close(loss, 4 * metrics["mse"])  # D = 4
    assert 0 < loss < 1  # ||g / (||g|| + c)||^2 < 1
    with pytest.raises(ValueError, match="unknown logvar_loss 'max'; valid: mean, sum"):
        SCM(logvar_loss="max")


def test_without_adaptive_weighting_the_loss_is_the_plain_mean():
    """adaptive_weighting=False: no logvar head (no parameters, nothing in the state) and the loss is the mean of
    ||F - F- - g||^2 / D; with the head, a logvar of 1 gives exp(-1) times it plus 1."""
    plain = SCM(warmup_steps=0, adaptive_weighting=False)
    assert not list(plain.parameters()) and not plain.state_dict()
    torch.manual_seed(2)
    loss, metrics = plain.loss(PointMassTrigFlow(A, offset=0.3), _data(8))
    torch.testing.assert_close(loss, metrics["mse"])
    weighted = SCM(warmup_steps=0)
    with torch.no_grad():
        weighted.logvar.linear.bias.fill_(1.0)
    torch.manual_seed(2)
    loss, metrics = weighted.loss(PointMassTrigFlow(A, offset=0.3), _data(8))
    torch.testing.assert_close(loss, torch.exp(torch.tensor(-1.0)) * metrics["mse"] + 1)


def test_hf_weight_weighs_the_pixel_scale_part_of_the_update(monkeypatch):
    """With hf_weight the per-sample error ||F - F- - g||^2 gains hf_weight ||high_pass(F - F- - g)||^2 (at the
    zero-initialised logvar, the loss is their mean over samples / D); the logged mse stays the plain one."""
    from flm.objectives import consistency, frequency

    seen = []
    monkeypatch.setattr(consistency, "squared_error", lambda err, w: seen.append(err) or frequency.squared_error(err, w))
    x = torch.randn(8, 1, 8, 8)
    torch.manual_seed(3)
    loss, metrics = SCM(warmup_steps=0, hf_weight=5.0).loss(tiny_dit(channels=1), x)
    (err,) = seen
    assert frequency.high_pass(err).abs().max() > 1e-2  # random data and weights: the error has a pixel-scale part
    expected = (err.square().flatten(1).sum(1) + 5.0 * frequency.high_pass(err).square().flatten(1).sum(1)) / 64
    torch.testing.assert_close(loss, expected.mean())
    torch.testing.assert_close(metrics["mse"], err.square().mean())
    with pytest.raises(ValueError, match="hf_weight"):
        SCM(hf_weight=-1.0)


def test_guidance_in_training_keeps_the_exact_solution():
    """With point-mass data the null-class velocity sigma_d F is the exact dx_t/dt too, so the guided velocity is
    the flow's own and the loss stays ~0 for any omega (a wrong mix of the two would not)."""
    model = PointMassTrigFlow(A)
    model.num_classes = 3
    torch.manual_seed(0)
    loss, metrics = SCM(warmup_steps=0, cfg_omega=3.0).loss(model, _data(), torch.randint(0, 3, (64,)), step=5)
    assert metrics["tangent_norm"] < 1e-4 and loss.abs() < 1e-9


def test_guided_dxdt_mixes_in_the_null_class_velocity_where_labels_are_kept():
    """F = the label's value (null: 0), so sigma_d F(. | null) = 0 and the guided velocity is omega dx_t/dt for kept
    labels, dx_t/dt for dropped ones and outside cfg_interval."""
    model, dx_t = LabelVelocity(), torch.randn(4, 1, 2, 2)
    y = torch.tensor([0, 2, 3, 1])  # 3 is the null class
    t = torch.tensor([0.5, 1.2, 0.5, 0.1])
    out = SCM(cfg_omega=2.5).guided_dxdt(model, torch.randn(4, 1, 2, 2), t, dx_t, y)
    torch.testing.assert_close(out, torch.cat([2.5 * dx_t[:2], dx_t[2:3], 2.5 * dx_t[3:]]))
    out = SCM(cfg_omega=2.5, cfg_interval=(0.3, 1.0)).guided_dxdt(model, torch.randn(4, 1, 2, 2), t, dx_t, y)
    torch.testing.assert_close(out, torch.cat([2.5 * dx_t[:1], dx_t[1:]]))


def test_the_velocity_head_learns_the_velocity_and_gives_the_null_velocity():
    """velocity_weight > 0: the loss adds velocity_weight x ||sigma_d V - dx_t/dt||^2 / D from the same forward as F (its
    gradient reaches the head), and guidance in training takes sigma_d V(. | null) as the null velocity."""
    scm = SCM(warmup_steps=0, velocity_weight=2.0, cfg_omega=2.0)
    assert scm.velocity_head and not SCM().velocity_head
    model = tiny_dit(velocity_head=True, channels=1, input_size=4)
    x, y = torch.randn(8, 1, 4, 4), torch.randint(0, 10, (8,))
    torch.manual_seed(0)
    loss, metrics = scm.loss(model, x, y, step=3)
    torch.manual_seed(0)
    plain, _ = SCM(warmup_steps=0, cfg_omega=2.0).loss(model, x, y, step=3)  # guided by sigma_d F(null): another target
    assert metrics["velocity_mse"] > 0 and not torch.allclose(loss, plain)
    loss.backward()
    assert model.velocity_layer.linear.weight.grad.abs().sum() > 0

    x_t, t, dx_t = torch.randn(8, 1, 4, 4), torch.rand(8), torch.randn(8, 1, 4, 4)
    keep = torch.randint(0, 10, (8,))
    v_null = 0.5 * model(x_t / 0.5, t, None, torch.full_like(keep, 10), head="velocity")
    torch.testing.assert_close(scm.guided_dxdt(model, x_t, t, dx_t, keep), 2.0 * dx_t - v_null)


def test_the_velocity_head_needs_a_model_with_one():
    with pytest.raises(ValueError, match="velocity_weight must be >= 0"):
        SCM(velocity_weight=-1.0)
    with pytest.raises(ValueError, match="on a model built with velocity_head=True"):
        model, x, y = tiny_dit(channels=1, input_size=4), torch.randn(4, 1, 4, 4), torch.zeros(4, dtype=torch.long)
        SCM(velocity_weight=1.0).loss(model, x, y)


def test_guidance_in_training_config_errors():
    with pytest.raises(ValueError, match="cfg_omega must be > 0"):
        SCM(cfg_omega=0.0)
    with pytest.raises(ValueError, match="class-conditional model and labels"):
        SCM(cfg_omega=2.0).loss(PointMassTrigFlow(A), _data())


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_sampler_with_the_exact_consistency_function_lands_on_the_data(steps):
    noise = torch.randn(16, 1, 2, 2)
    x = SCM().sample(PointMassTrigFlow(A), noise, steps=steps)
    torch.testing.assert_close(x, torch.full_like(x, A), rtol=0, atol=1e-4)
    away = SCM().sample(PointMassTrigFlow(A, offset=0.3), noise, steps=steps)
    assert (away - A).abs().max() > 1e-2


def test_sample_times():
    scm = SCM()
    assert scm.sample_times(2) == [pytest.approx(1.56454, abs=1e-4), 1.1]
    assert len(scm.sample_times(4)) == 4


def _generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_multi_step_sampling_depends_only_on_each_images_generator():
    model = tiny_dit(num_classes=0, channels=1, input_size=8)
    scm, noise = SCM(), torch.randn(5, 1, 8, 8)
    whole = scm.sample(model, noise, steps=3, generators=_generators(range(5)))
    split = torch.cat(
        [
            scm.sample(model, noise[:2], steps=3, generators=_generators(range(2))),
            scm.sample(model, noise[2:], steps=3, generators=_generators(range(2, 5))),
        ]
    )
    torch.testing.assert_close(whole, split, rtol=1e-5, atol=1e-5)
    reordered = scm.sample(model, noise.flip(0), steps=3, generators=_generators(range(4, -1, -1)))
    torch.testing.assert_close(whole, reordered.flip(0), rtol=1e-5, atol=1e-5)
    other = scm.sample(model, noise, steps=3, generators=_generators(range(10, 15)))  # the re-noising matters
    assert (other - whole).abs().max() > 1e-3
    with pytest.raises(ValueError, match="got 2 generators for 5 images; pass one per image"):
        scm.sample(model, noise, steps=2, generators=_generators(range(2)))


def test_gamma_mixes_the_implied_noise_with_fresh_noise():
    model = tiny_dit(num_classes=0, channels=1, input_size=8)
    noise = torch.randn(3, 1, 8, 8)

    def by_hand(scm, gamma):  # 2 steps: x0 from the noise, re-noised at mid_t with the gamma mix, x0 again
        t0, s = scm.sample_times(2)
        x_t = scm.sigma_d * noise
        x0 = scm.consistency_fn(model, x_t, t0, None)
        implied = (x_t - math.cos(t0) * x0) / (math.sin(t0) * scm.sigma_d)
        fresh = torch.stack([torch.randn(noise.shape[1:], generator=g) for g in _generators(range(3))])
        eps = math.sqrt(1 - gamma**2) * implied + gamma * fresh
        return scm.consistency_fn(model, math.cos(s) * x0 + math.sin(s) * scm.sigma_d * eps, s, None)

    for gamma in (1.0, 0.6, 0.0):
        got = SCM(gamma=gamma).sample(model, noise, steps=2, generators=_generators(range(3)))
        torch.testing.assert_close(got, by_hand(SCM(gamma=gamma), gamma), rtol=1e-5, atol=1e-5)
    # gamma 0 draws nothing: deterministic whatever the generators; gamma 1 is the paper's sampler, fresh noise only
    deterministic = SCM(gamma=0.0)
    a = deterministic.sample(model, noise, steps=3, generators=_generators(range(3)))
    torch.testing.assert_close(a, deterministic.sample(model, noise, steps=3, generators=_generators(range(7, 10))))
    assert (a - SCM().sample(model, noise, steps=3, generators=_generators(range(3)))).abs().max() > 1e-3
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"gamma must lie in \[0, 1\]"):
            SCM(gamma=bad)


@pytest.mark.parametrize("step", [0, 1, 3, 7])
def test_step_as_a_tensor_gives_the_loss_of_the_int_step(step):
    # a CUDA-graph training step passes the step as a 0-dim tensor (flm.train.loop)
    scm = SCM(warmup_steps=4)
    model = tiny_dit()
    x, y = torch.randn(4, 3, 8, 8), torch.arange(4)
    losses = []
    for s in (step, torch.tensor(step)):
        torch.manual_seed(0)
        losses.append(scm.loss(model, x, y, step=s)[0])
    assert torch.equal(losses[0], losses[1])


@pytest.mark.parametrize("jvp_mode", ["dual", "two_pass", "func"])
def test_a_data_predicting_model_at_the_exact_clean_image_has_zero_loss(jvp_mode):
    # F is built from x^ (model.prediction=data): x^ = a / sigma_d at every t is the exact consistency function wherever
    # sin t >= SIN_MIN, which a narrow proposal around tan t = 2 keeps to
    objective = SCM(warmup_steps=0, p_mean=0.0, p_std=0.1, jvp_mode=jvp_mode)
    torch.manual_seed(0)
    loss, metrics = objective.loss(PointMassData(A), _data())
    assert metrics["tangent_norm"] < 1e-4 and loss.abs() < 1e-9
    torch.manual_seed(0)
    assert objective.loss(PointMassData(A, offset=0.3), _data())[1]["tangent_norm"] > 1e-2


@pytest.mark.parametrize("steps", [1, 2])
def test_a_data_predicting_models_samples_are_its_clean_image(steps):
    x = SCM().sample(PointMassData(A), torch.randn(16, 1, 2, 2), steps=steps)
    torch.testing.assert_close(x, torch.full_like(x, A), rtol=0, atol=1e-5)


def test_a_data_predicting_models_consistency_function_meets_the_boundary_condition():
    model = tiny_dit(channels=1, input_size=4)
    model.prediction = "data"
    scm, x, y = SCM(), torch.randn(3, 1, 4, 4), torch.tensor([0, 1, 2])
    torch.testing.assert_close(scm.consistency_fn(model, x, 0.0, y), x)  # f(x, 0) = x
    small = scm.consistency_fn(model, x, 1e-3, y)  # below SIN_MIN f blends into x continuously
    assert (small - x).abs().max() < 0.1 * (scm.consistency_fn(model, x, 0.5, y) - x).abs().max()
    t = 2 * SIN_MIN  # above it f is sigma_d x^ itself
    u = model(x / scm.sigma_d, torch.full((3,), t), None, y)
    x_hat = x / scm.sigma_d - t * u
    torch.testing.assert_close(scm.consistency_fn(model, x, t, y), scm.sigma_d * x_hat, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("alpha", [1.0, 0.3, 0.01])
def test_the_curriculums_tangent_is_the_finite_difference_of_f(alpha):
    """F = exact + c t gives f(x, t) = a - sin t sigma_d c t on every trajectory of the point mass, so the curriculum's
    g = cos t (f(t) - f(s)) / (t - s) at s = (1 - alpha) t is -cos t sigma_d c (t sin t - s sin s) / (t - s); the
    exact consistency function has g = 0 and zero loss at every alpha."""
    c, sigma_d = 0.3, 0.5
    objective = SCM(sigma_d=sigma_d, alpha_steps=[0, 10])
    torch.manual_seed(0)
    x = _data(8)
    t = torch.linspace(0.2, 1.4, 8)
    s = objective.path.sample(x, torch.randn_like(x), t)
    model = PointMassTrigFlow(A, offset=c, sigma_d=sigma_d)
    F_minus = model(s.x_t / sigma_d, t).float()
    g = objective.discrete_tangent(model, F_minus, s.x_t, t, s.dx_t, None, alpha)
    t_s = (1 - alpha) * t
    expected = -torch.cos(t) * sigma_d * c * (t * torch.sin(t) - t_s * torch.sin(t_s)) / (t - t_s)
    torch.testing.assert_close(g, expected.reshape(-1, 1, 1, 1).expand_as(g), rtol=1e-4, atol=1e-4)  # fp32 differences
    torch.manual_seed(0)
    loss, metrics = objective.loss(PointMassTrigFlow(A, sigma_d=sigma_d), _data(), step=5)
    assert metrics["tangent_norm"] < 1e-4 and loss.abs() < 1e-9 and 0 < metrics["alpha"] < 1


@pytest.mark.parametrize("cfg_omega", [1.0, 2.0])
def test_the_curriculums_gradient_tends_to_sCTs_as_alpha_falls(cfg_omega):
    """The finite difference's gradient is sCT's (at full warm-up) in the limit: < 1e-2 apart (relative L2) at alpha 1e-3,
    far more at 0.5; with guidance in training the step follows the guided dx_t/dt."""
    distance = gradient_distances(lambda **kw: SCM(warmup_steps=0, cfg_omega=cfg_omega, **kw), time_inputs=1)
    assert distance[1e-3] < 1e-2 and distance[0.5] > 5 * distance[1e-3], distance


def test_the_curriculums_step_kinds_and_its_refusals():
    from flm.objectives import build_objective

    objective = SCM(alpha_steps=[100, 300])
    assert [objective.phase(k) for k in (0, 299, 300)] == ["alpha", "alpha", "jvp"] and SCM().phase(5) is None
    with pytest.raises(ValueError, match="alpha_steps must be"):
        SCM(alpha_steps=[3, 1])
    for name in ("scd", "rcm"):  # sCD's students drifted from the toy's exact map with it (docs/quality.md)
        with pytest.raises(ValueError, match="alpha_steps .* not sCD's"):
            build_objective(name, teacher="unused", alpha_steps=[0, 10])
