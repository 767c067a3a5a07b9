"""The Gaussian-mixture toy of benchmarks/toy.py: its exact flow maps, and objectives trained on it."""

import math

import pytest
import torch

from benchmarks.toy import (
    GMM,
    default_gmm,
    energy_distance,
    fit,
    flow_map,
    linear_velocity,
    scm_guided_velocity,
    train,
    trig_velocity,
)


def test_linear_flow_map_of_one_gaussian_is_the_affine_map():
    """x_t = (1 - t) x0 + t eps with x0 ~ N(mu, s^2): the flow carries noise n to mu + s n."""
    mu, s = torch.tensor([[0.7, -0.3, 0.2]]), 0.2
    n = torch.randn(200, 3, dtype=torch.float64)
    x0 = flow_map(linear_velocity(GMM(mu, s)), n, 1.0, 0.0)
    torch.testing.assert_close(x0, mu.double() + s * n, atol=1e-8, rtol=0)


def test_trigflow_flow_map_of_one_gaussian_keeps_the_standardised_point():
    """x_t = cos t x0 + sin t z: x_t ~ N(cos t mu, cos^2 t s^2 + sin^2 t sigma_d^2), the flow keeps the
    standardised coordinate, from t = 1.4 down to the data."""
    mu, s, sigma_d, t = torch.tensor([[0.5, 1.0]]), 0.3, 0.5, 1.4
    x_t = torch.randn(200, 2, dtype=torch.float64)
    x0 = flow_map(trig_velocity(GMM(mu, s), sigma_d), x_t, t, 0.0)
    std_t = math.sqrt(math.cos(t) ** 2 * s**2 + math.sin(t) ** 2 * sigma_d**2)
    torch.testing.assert_close(x0, mu.double() + s * (x_t - math.cos(t) * mu.double()) / std_t, atol=1e-8, rtol=0)


@pytest.mark.parametrize("velocity", ["linear", "trig"])
def test_exact_map_of_the_mixture_lands_on_the_mixture(velocity):
    g = torch.Generator().manual_seed(0)
    gmm = default_gmm()
    n = torch.randn(800, 2, generator=g, dtype=torch.float64)
    if velocity == "linear":
        x0 = flow_map(linear_velocity(gmm), n, 1.0, 0.0)
    else:
        x0 = flow_map(trig_velocity(gmm, 0.5), 0.5 * n, math.atan(80 / 0.5), 0.0)
    data = gmm.sample(800, generator=g)
    floor = energy_distance(gmm.sample(800, generator=g), data)
    tol = 3 * floor + 2e-3
    assert energy_distance(x0, data) < tol
    assert energy_distance(n, data) > 5 * tol  # the test can tell noise from data


def test_class_conditional_map_is_its_components_affine_map():
    """Conditioned on component k alone the flow is one Gaussian's: noise n goes to mu_k + s n, whatever the
    mixture's weights; guidance (omega 3) pushes samples of the same noise away from the other classes' modes, out of
    the ring."""
    gmm = default_gmm()
    n = torch.randn(400, 2, dtype=torch.float64)
    k = torch.arange(400) % gmm.num_classes
    x0 = flow_map(linear_velocity(gmm, k), n, 1.0, 0.0)
    torch.testing.assert_close(x0, gmm.means[k] + gmm.s * n, atol=1e-6, rtol=0)  # RK4 at s = 0.1: 6e-8
    guided = flow_map(linear_velocity(gmm, k, omega=3.0), n, 1.0, 0.0)
    assert guided.norm(dim=1).mean() > x0.norm(dim=1).mean() + 0.1


def test_scm_guidance_field_is_not_the_velocity():
    """sigma_d F of the exact consistency model (what sCM's cfg_omega puts in place of the null velocity; the field at
    omega = 0) differs from the flow's velocity v by tan t (x + sigma_d dF/dt), dF/dt along the flow: the identity
    holds to a central difference's error, and the difference is a large part of v."""
    gmm, sigma_d, n, h = default_gmm(), 0.5, 100, 1e-3
    g = torch.Generator().manual_seed(0)
    sigma_d_F = scm_guided_velocity(gmm, sigma_d, torch.arange(n) % gmm.num_classes, omega=0.0, steps=200)
    for t in (0.5, 1.0):
        x = math.cos(t) * gmm.sample(n, generator=g) + math.sin(t) * sigma_d * torch.randn(n, 2, generator=g, dtype=torch.float64)
        at = lambda s: torch.full((n,), s, dtype=torch.float64)  # noqa: E731
        v = trig_velocity(gmm, sigma_d)(x, at(t))
        dF_dt = (sigma_d_F(x + h * v, at(t + h)) - sigma_d_F(x - h * v, at(t - h))) / (2 * h * sigma_d)
        rebuilt = sigma_d_F(x, at(t)) + math.tan(t) * (x + sigma_d * dF_dt)
        torch.testing.assert_close(rebuilt, v, atol=2e-4, rtol=0)
        assert (sigma_d_F(x, at(t)) - v).norm(dim=1).mean() > 0.3 * v.norm(dim=1).mean()


@pytest.fixture
def one_thread():
    """Tiny MLPs run fastest on one thread (and leave the other cores alone)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_meanflow_one_step_map_approaches_the_exact_map(one_thread):
    """A short MeanFlow run: its one-step map is far closer to the exact flow map than the best
    constant map (the data mean, err ~ 1 on the unit ring) and than one Euler step of flow matching."""
    small = dict(steps=300, eval_every=300, batch=128, hidden=64, n_eval=300, log=lambda _: None)
    mf = train("meanflow", adaptive_p=0.0, **small)[-1]
    fm = train("flow_matching", **small)[-1]
    assert mf["err1"] < 0.3 and mf["err1"] < 0.3 * fm["err1"]


@pytest.mark.parametrize("objective", ["scd", "rcm"])
def test_distillation_from_the_exact_velocity_approaches_the_exact_map(objective, one_thread):
    """sCD / rCM from the exact marginal velocity (benchmarks/toy.py's ExactTeacher): after a short run the
    student's one-step map is far closer to the exact flow map than one Euler step of flow matching."""
    small = dict(steps=300, eval_every=300, batch=128, hidden=64, n_eval=300, log=lambda _: None)
    student = train(objective, warmup_steps=30, **small)[-1]
    fm = train("flow_matching", **small)[-1]
    assert student["err1"] < 0.3 and student["err1"] < 0.3 * fm["err1"]


@pytest.mark.parametrize("target_decay", [0.9, 0.99])
def test_the_toy_keeps_an_objectives_target_ema_beside_the_scored_one(target_decay, one_thread, monkeypatch):
    """sCD's one_step_ema gets an EMA of the student as `ema`: its own copy when the decay differs from the scored
    EMA's, the scored one when it is the same (a second copy under the same key left the scored EMA unaveraged)."""
    from benchmarks import toy

    seen = []
    original = toy.build_objective

    def build(name, **kwargs):
        objective = original(name, **kwargs)
        loss = objective.loss
        objective.loss = lambda *a, ema=None, **k: seen.append(ema) or loss(*a, ema=ema, **k)
        return objective

    monkeypatch.setattr(toy, "build_objective", build)
    small = dict(steps=4, eval_every=4, batch=16, hidden=16, n_eval=50, log=lambda _: None, ema=0.99)
    history, scored = fit("scd", warmup_steps=2, one_step_frac=0.5, teacher_steps=2, one_step_ema=target_decay, **small)
    assert len(seen) == 4 and all(e is seen[0] and e is not None for e in seen)
    assert (seen[0] is scored) == (target_decay == 0.99)  # one EMA at a shared decay, the scored one moving
    assert len(history) == 1


def test_classes_refuse_the_unconditional_teachers():
    with pytest.raises(ValueError, match="the toy's teachers are unconditional; distil without classes"):
        fit("scd", steps=1, classes=True, log=lambda _: None)
