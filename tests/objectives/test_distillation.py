"""sCD, rCM and MeanFlow's teacher option (flm.objectives.distillation, flm.objectives.teacher): the time
conversion on a Gaussian, the student at its start, the JVP modes and the fused attention, alternation."""

import contextlib
import copy
import math

import pytest
import torch

from flm.objectives import RCM, RCMGAN, SCD, MeanFlow, MeanFlowDMD, build_objective, distillation
from flm.objectives.adversarial import Discriminator
from flm.objectives.frequency import high_pass
from flm.objectives.teacher import flow_time, trigflow_velocity
from tests.models.tiny import plain_layers, tiny_dit, with_backend
from tests.objectives.test_jvp_modes import SETUPS
from tests.objectives.toys import GaussianVelocity


@pytest.mark.parametrize("sigma_d", [0.5, 1.0])
def test_the_converted_flow_matching_velocity_is_trigflows_exact_one_on_a_gaussian(sigma_d):
    """Data N(mu, s^2): the exact flow-matching velocity through the conversion equals E[dx_t/dt | x_t] on
    TrigFlow's path x_t = cos(t) x + sin(t) sigma_d eps, computed from the Gaussian's posterior."""
    mu, s = 0.7, 0.3
    t = torch.linspace(0.05, math.pi / 2 - 0.01, 9, dtype=torch.float64)
    x_t = torch.randn(9, 5, dtype=torch.float64)
    converted = trigflow_velocity(GaussianVelocity(mu, s), x_t, t, sigma_d)
    cos_t, sin_t = torch.cos(t)[:, None], torch.sin(t)[:, None]
    var = cos_t**2 * s**2 + sin_t**2 * sigma_d**2
    x0 = mu + cos_t * s**2 * (x_t - cos_t * mu) / var  # E[x | x_t]
    eps = sin_t * sigma_d * (x_t - cos_t * mu) / var  # E[eps | x_t]
    torch.testing.assert_close(converted, -sin_t * x0 + sigma_d * cos_t * eps, rtol=1e-10, atol=1e-10)


def test_flow_time_maps_trigflows_ends_to_flow_matchings():
    t = torch.tensor([0.0, math.atan(1 / 0.5), math.pi / 2])
    torch.testing.assert_close(flow_time(t, 0.5), torch.tensor([0.0, 0.5, 1.0]))


def test_a_student_equal_to_its_teacher_predicts_the_teachers_x():
    """f(x_t, t) of a flow-matching network is x_s - s v(x_s, s) at x_s = x_t / c(t), s = s(t)."""
    scd, model = SCD(teacher="unused"), tiny_dit()
    x_t, y, t = torch.randn(2, 3, 8, 8), torch.tensor([1, 4]), 1.1
    c = math.cos(t) + scd.sigma_d * math.sin(t)
    s = torch.full((2,), scd.sigma_d * math.sin(t) / c)
    x_s = x_t / c
    with torch.no_grad():
        expected = x_s - s[0] * model(x_s, s, None, y)
    torch.testing.assert_close(scd.consistency_fn(model, x_t, t, y), expected, rtol=1e-5, atol=1e-5)


def test_scd_from_an_exact_teacher_has_a_zero_target_at_the_start():
    """The student is its teacher: sigma_d F- equals the teacher's dx_t/dt, so without tangent warm-up
    (step 0) the target g is zero and so is the mse."""
    scd, model = SCD(teacher="unused"), tiny_dit()
    loss, metrics = scd.loss(model, torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3]), step=0, teacher=model)
    assert metrics["mse"] < 1e-10 and metrics["tangent_norm"] < 1e-5


def _student_step(name, backend, mode, plain=False, **options):
    kwargs = {"teacher": "unused", "jvp_mode": mode, "teacher_cfg_scale": 1.5, **options}
    kwargs |= {"r_neq_t": 1.0, "label_dropout": 0.0} if name.startswith("meanflow") else {"warmup_steps": 4}
    objective = build_objective(name, **kwargs)
    student = with_backend(tiny_dit(time_inputs=objective.time_inputs, seed=1), backend)
    networks = {"teacher": tiny_dit(seed=2).requires_grad_(False)}
    if name in ("rcm", "meanflow_dmd", "rcm_gan"):
        networks["fake_score"] = tiny_dit(seed=3).requires_grad_(False)
    if name.endswith("gan"):
        torch.manual_seed(3)
        networks["discriminator"] = Discriminator(3, 10, width=8, depth=2).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.tensor([0, 3, 7, 9])
    torch.manual_seed(1)
    with plain_layers() if plain else contextlib.nullcontext():
        loss, metrics = objective.loss(student, x, y, step=3, **networks)  # rCM: step 3 updates the student
    loss = loss["model"] if isinstance(loss, dict) else loss
    params = list(student.parameters()) + list(objective.parameters())
    return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize(
    "name, options",
    [
        ("scd", {}),
        ("scd", {"one_step_frac": 0.5, "teacher_steps": 2}),
        ("rcm", {}),
        ("meanflow_dmd", {}),
        ("meanflow_gan", {}),
        ("rcm_gan", {"adv_weight": 1.0}),
    ],
)
def test_student_gradients_agree_across_jvp_modes_and_the_fused_attention(name, options):
    loss_ref, grads_ref = _student_step(name, "math", "two_pass", plain=True, **options)
    assert sum(g.norm() for g in grads_ref if g is not None) > 1e-2
    for backend, mode in SETUPS:
        loss, grads = _student_step(name, backend, mode, **options)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-6)
        for g, g_ref in zip(grads, grads_ref):
            assert (g is None) == (g_ref is None)
            if g is not None:
                torch.testing.assert_close(g, g_ref, rtol=1e-3, atol=1e-5, msg=f"{backend}/{mode}")


def test_rcm_gan_adds_the_adversarial_term_in_the_students_dmd_steps_alone():
    """dmd_start 2, fake_updates 1: sCD alone at steps 0 and 1, the fake score at 2, then the student with DMD and the
    GAN term, whose loss is rCM's (the same draws come first) plus adv_weight times the term; also with the phase given
    and the step a tensor, as under CUDA graphs."""
    options = {"teacher": "unused", "dmd_start": 2, "warmup_steps": 4, "dmd_weight": 0.5}
    gan, rcm = RCMGAN(adv_weight=0.7, **options), RCM(**options)
    student, teacher, fake = tiny_dit(seed=1), tiny_dit(seed=2).requires_grad_(False), tiny_dit(seed=3)
    torch.manual_seed(3)
    disc = Discriminator(3, 10, width=8, depth=2)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 3, 7, 9])
    for step, phase, keys in [
        (0, None, {"model"}),
        (1, None, {"model"}),
        (2, None, {"fake_score"}),
        (3, None, {"model", "discriminator"}),
        (torch.tensor(3), "model", {"model", "discriminator"}),
    ]:
        torch.manual_seed(5)
        losses, metrics = gan.loss(student, x, y, step=step, phase=phase, teacher=teacher, fake_score=fake, discriminator=disc)
        assert set(losses) == keys, step
        torch.manual_seed(5)
        plain, _ = rcm.loss(student, x, y, step=step, phase=phase, teacher=teacher, fake_score=fake)
        extra = 0.7 * metrics["adv"] if "discriminator" in keys else 0.0
        for key in plain:
            torch.testing.assert_close(losses[key], plain[key] + (extra if key == "model" else 0.0))
        if "discriminator" in keys:  # the discriminator's loss trains it alone; the student's term reaches the student
            assert all(
                g is None
                for g in torch.autograd.grad(
                    losses["discriminator"], list(student.parameters()), retain_graph=True, allow_unused=True
                )
            )
            assert all(g is None for g in torch.autograd.grad(losses["model"], list(disc.parameters()), allow_unused=True))


def test_rcm_alternates_fake_score_and_student_updates():
    rcm = RCM(teacher="unused", fake_updates=2)
    student, teacher, fake = tiny_dit(seed=1), tiny_dit(seed=2).requires_grad_(False), tiny_dit(seed=3)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    for step, updated in [(0, "fake_score"), (1, "fake_score"), (2, "model"), (3, "fake_score"), (5, "model")]:
        losses, _ = rcm.loss(student, x, y, step=step, teacher=teacher, fake_score=fake)
        assert list(losses) == [updated]
        params = {"model": student, "fake_score": fake}
        grads = {
            n: torch.autograd.grad(losses[updated], list(m.parameters()), allow_unused=True)
            for n, m in params.items()
            if any(p.requires_grad for p in m.parameters())
        }
        for name, g in grads.items():
            assert any(gi is not None for gi in g) == (name == updated), (step, name)


@pytest.mark.parametrize("fake_updates", [1, 0])
@pytest.mark.parametrize("regularised, plain", [(RCM, SCD), (MeanFlowDMD, MeanFlow)])
def test_dmd_start_runs_the_distillation_alone_first(regularised, plain, fake_updates):
    """Before dmd_start every step is the student's plain distillation step (no DMD, the fake score untouched); then
    the alternation starts, counted from dmd_start."""
    dmd = regularised(teacher="unused", dmd_weight=1.0, fake_updates=fake_updates, dmd_start=3)
    base = plain(teacher="unused")
    expected = ["distill"] * 3 + (["fake_score", "model"] * 2 if fake_updates else ["model"] * 4)
    assert [dmd.phase(step) for step in range(7)] == expected
    student, teacher = tiny_dit(time_inputs=base.time_inputs, seed=1), tiny_dit(seed=2).requires_grad_(False)
    fake = tiny_dit(seed=3)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    torch.manual_seed(0)
    losses, metrics = dmd.loss(student, x, y, step=2, teacher=teacher, fake_score=fake)
    torch.manual_seed(0)
    base_loss, _ = base.loss(student, x, y, step=2, teacher=teacher)
    assert list(losses) == ["model"] and "dmd" not in metrics and "fake_loss" not in metrics
    torch.testing.assert_close(losses["model"], base_loss)
    assert all(g is None for g in torch.autograd.grad(losses["model"], list(fake.parameters()), allow_unused=True))
    losses, metrics = dmd.loss(student, x, y, step=4 if fake_updates else 3, teacher=teacher, fake_score=fake)
    assert "dmd" in metrics  # the student's steps from dmd_start on carry the DMD term
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="dmd_start must be an integer >= 0"):
            regularised(teacher="unused", dmd_start=bad)
    assert regularised(teacher="unused", fake_lr=4e-5).networks["fake_score"].optim == {"lr": 4e-5}  # optim.*'s else
    tuned = regularised(teacher="unused", fake_lr=4e-5, fake_betas=[0.0, 0.999], fake_weight_decay=0.01)
    assert tuned.networks["fake_score"].optim == {"lr": 4e-5, "betas": (0.0, 0.999), "weight_decay": 0.01}
    for bad in ({"fake_betas": [0.9]}, {"fake_betas": [0.9, 1.0]}, {"fake_betas": 0.9}, {"fake_weight_decay": -0.1}):
        with pytest.raises(ValueError, match="fake_betas must be two numbers|fake_weight_decay must be a number"):
            regularised(teacher="unused", **bad)


@pytest.mark.parametrize("fake_updates", [1, 0])
@pytest.mark.parametrize("regularised, plain", [(RCM, SCD), (MeanFlowDMD, MeanFlow)])
def test_the_dmd_gradient_vanishes_when_the_fake_score_is_the_teacher(regularised, plain, fake_updates):
    """grad = x_fake - x_real (normalised) is zero when both scores agree: rCM's loss is then sCD's, and
    MeanFlow + DMD's that of MeanFlow with the teacher."""
    dmd, base = regularised(teacher="unused", dmd_weight=1.0, fake_updates=fake_updates), plain(teacher="unused")
    student, teacher = tiny_dit(time_inputs=base.time_inputs, seed=1), tiny_dit(seed=2).requires_grad_(False)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    torch.manual_seed(0)
    losses, metrics = dmd.loss(student, x, y, step=1, teacher=teacher, fake_score=copy.deepcopy(teacher))
    torch.manual_seed(0)
    base_loss, _ = base.loss(student, x, y, step=1, teacher=teacher)
    assert metrics["dmd"] == 0
    torch.testing.assert_close(losses["model"], base_loss)


@pytest.mark.parametrize("regularised", [RCM, MeanFlowDMD])
def test_fake_updates_0_trains_the_fake_score_in_the_students_step(regularised):
    """Every step updates both networks; each loss reaches its own network only, and the DMD term the student."""
    objective = regularised(teacher="unused", dmd_weight=1.0, fake_updates=0)
    student = tiny_dit(time_inputs=objective.time_inputs, seed=1)
    teacher, fake = tiny_dit(seed=2).requires_grad_(False), tiny_dit(seed=3)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    for step in range(3):
        assert objective.phase(step) == "model"
        losses, metrics = objective.loss(student, x, y, step=step, teacher=teacher, fake_score=fake)
        assert sorted(losses) == ["fake_score", "model"] and metrics["dmd"] > 0
        for name, own, other in [("model", student, fake), ("fake_score", fake, student)]:
            own_grads = torch.autograd.grad(losses[name], list(own.parameters()), allow_unused=True, retain_graph=True)
            other_grads = torch.autograd.grad(losses[name], list(other.parameters()), allow_unused=True, retain_graph=True)
            assert any(g is not None and g.abs().sum() > 0 for g in own_grads), name
            assert all(g is None for g in other_grads), name


@pytest.mark.parametrize("regularised, plain", [(RCM, SCD), (MeanFlowDMD, MeanFlow)])
def test_distill_weight_scales_the_distillation_loss_and_0_leaves_dmd_alone(regularised, plain):
    """In the steps with DMD the distillation loss counts distill_weight times; at 0 it is not computed at all (the
    teacher runs once, for DMD's real score) and the student learns from DMD alone."""
    base = plain(teacher="unused")  # built before the seed: building draws random numbers
    student = tiny_dit(time_inputs=base.time_inputs, seed=1)
    teacher, fake = tiny_dit(seed=2).requires_grad_(False), tiny_dit(seed=3)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])

    def student_loss(distill_weight):
        dmd = regularised(teacher="unused", dmd_weight=1.0, fake_updates=1, distill_weight=distill_weight)
        torch.manual_seed(0)
        return dmd.loss(student, x, y, step=1, teacher=teacher, fake_score=fake)

    torch.manual_seed(0)
    distill, _ = base.loss(student, x, y, step=1, teacher=teacher)
    whole, half = student_loss(1.0)[0]["model"], student_loss(0.5)[0]["model"]
    torch.testing.assert_close(half, whole - 0.5 * distill)
    calls = []
    hook = teacher.register_forward_hook(lambda *args: calls.append(1))
    losses, metrics = student_loss(0.0)
    hook.remove()
    assert len(calls) == 1 and "mse" not in metrics and metrics["dmd"] > 0
    torch.testing.assert_close(losses["model"], metrics["dmd"])
    grads = torch.autograd.grad(losses["model"], list(student.parameters()), allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("frac, k", [(0.0, 0), (0.5, 2), (1.0, 4)])
def test_rcms_generator_draws_its_first_share_with_the_two_step_sampler(frac, k):
    """The first round(dmd_two_step_frac B) samples are the 2-step sampler's (fresh noise at mid_t), the rest the
    1-step sampler's, from the same noises; the gradient reaches the student through the last jump only."""
    objective = RCM(teacher="unused", dmd_two_step_frac=frac)
    student = tiny_dit(time_inputs=objective.time_inputs, seed=1)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    torch.manual_seed(0)
    x_g = objective.generate(student, x, y)
    torch.manual_seed(0)
    noise = torch.randn_like(x)
    two = objective.sample(student, noise[:k], y[:k], steps=2)  # its re-noising draws next, as generate's
    one = objective.sample(student, noise[k:], y[k:], steps=1)
    torch.testing.assert_close(x_g.detach(), torch.cat([two, one]))
    assert x_g.requires_grad
    with pytest.raises(ValueError, match="dmd_two_step_frac must be a probability"):
        RCM(teacher="unused", dmd_two_step_frac=1.5)
    with pytest.raises(ValueError, match="needs its intermediate time"):
        RCM(teacher="unused", dmd_two_step_frac=0.5, mid_t=())


def test_the_meanflow_students_generator_is_its_one_step_sampler():
    objective = MeanFlowDMD(teacher="unused")
    student, x, y = tiny_dit(time_inputs=2, seed=1), torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    torch.manual_seed(0)
    x_g = objective.generate(student, x, y)
    torch.manual_seed(0)
    expected = objective.sample(student, torch.randn_like(x), y, steps=1)
    assert x_g.requires_grad
    torch.testing.assert_close(x_g.detach(), expected)


def test_meanflow_with_a_teacher_regresses_on_the_teachers_velocity():
    """r = t everywhere: MeanFlow's target is v itself, the teacher's velocity in place of eps - x."""
    mf = MeanFlow(teacher="unused", r_neq_t=0.0, adaptive_p=0.0, label_dropout=0.0)
    student, teacher = tiny_dit(time_inputs=2, seed=1), tiny_dit(seed=2).requires_grad_(False)
    x, y = torch.randn(3, 3, 8, 8), torch.tensor([0, 1, 2])
    torch.manual_seed(0)
    loss, _ = mf.loss(student, x, y, teacher=teacher)
    torch.manual_seed(0)
    t, _ = mf.sample_times(3, None)
    z_t = mf.path.sample(x, torch.randn_like(x), t).x_t
    with torch.no_grad():
        expected = (student(z_t, t, t, y) - teacher(z_t, t, None, y)).square().flatten(1).sum(1).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"teacher": ""}, "objective.teacher is not set"),
        ({"teacher": "t", "teacher_cfg_scale": 0.5}, "teacher_cfg_scale must be >= 1.0"),
        ({"teacher": "t", "fake_updates": -1}, "fake_updates >= 0"),
        ({"teacher": "t", "dmd_weight": -1.0}, "dmd_weight >= 0"),
        ({"teacher": "t", "fake_lr": 0.0}, "fake_lr must be"),
        ({"teacher": "t", "distill_weight": -1.0}, "distill_weight must be a finite weight"),
        ({"teacher": "t", "distill_weight": float("inf")}, "distill_weight must be a finite weight"),
        ({"teacher": "t", "distill_weight": 0.0, "dmd_weight": 0.0}, "cannot both be 0"),
    ],
)
@pytest.mark.parametrize("regularised", [RCM, MeanFlowDMD])
def test_bad_options_are_refused(regularised, kwargs, message):
    with pytest.raises(ValueError, match=message):
        regularised(**kwargs)


def test_meanflow_refuses_a_teacher_with_guidance_in_training():
    with pytest.raises(ValueError, match="replaces guidance in training"):
        MeanFlow(teacher="t", cfg_omega=2.0)


@pytest.mark.parametrize("distilled", [SCD, RCM])
def test_scd_refuses_guidance_in_training(distilled):
    with pytest.raises(ValueError, match="replaces guidance in training"):
        distilled(teacher="t", cfg_omega=2.0)
    with pytest.raises(ValueError, match="and its velocity head.*objective.velocity_weight=0"):
        distilled(teacher="t", velocity_weight=1.0)


@pytest.mark.parametrize("solver", ["euler", "heun"])
def test_the_one_step_target_is_the_teachers_flow_matching_ode_solution_then_the_students_f(solver):
    """sCD's one_step_frac target, computed independently: Euler (or Heun) steps of the teacher's velocity in
    flow-matching coordinates (x_s = x_t / c(t), uniform in s) down to one_step_mid, back to TrigFlow, the student's
    f there."""
    scd = SCD(teacher="unused", one_step_frac=0.5, one_step_mid=0.8, teacher_steps=3, one_step_solver=solver)
    student, teacher = tiny_dit(seed=1), tiny_dit(seed=2)
    x_t, y = scd.sigma_d * torch.randn(2, 3, 8, 8), torch.tensor([1, 4])
    c = lambda t: math.cos(t) + scd.sigma_d * math.sin(t)  # noqa: E731
    s_grid = torch.linspace(flow_time(torch.tensor(scd.t_max), 0.5).item(), flow_time(torch.tensor(0.8), 0.5).item(), 4)
    x = x_t / c(scd.t_max)
    with torch.no_grad():
        for s, s_next in zip(s_grid[:-1], s_grid[1:]):
            v = teacher(x, s.expand(2), None, y)
            x_euler = x + (s_next - s) * v
            x = x_euler if solver == "euler" else x + (s_next - s) * (v + teacher(x_euler, s_next.expand(2), None, y)) / 2
        f_mid = scd.consistency_fn(student, c(0.8) * x, 0.8, y)
        dx_t = scd.teacher_dxdt(teacher, x_t, torch.full((2,), scd.t_max), y)
        target = scd.one_step_target(student, teacher, x_t, dx_t, y)
    assert scd.one_step_times()[0] == pytest.approx(scd.t_max) and scd.one_step_times()[-1] == pytest.approx(0.8)
    expected = (math.cos(scd.t_max) * x_t - f_mid) / (math.sin(scd.t_max) * scd.sigma_d)
    torch.testing.assert_close(target, expected, rtol=1e-4, atol=1e-4)


def test_the_one_step_share_takes_t_max_and_its_target_in_the_loss():
    """The batch's first one_step_frac samples are at t_max; their error is F - F_tgt, logged as one_step_mse."""
    scd = SCD(teacher="unused", one_step_frac=0.5, warmup_steps=0)
    student, teacher = tiny_dit(seed=1), tiny_dit(seed=2)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    times = []
    scd.logvar.register_forward_hook(lambda module, args, out: times.append(args[0].clone()))
    torch.manual_seed(0)
    loss, metrics = scd.loss(student, x, y, step=5, teacher=teacher)
    assert torch.equal(times[0][:2], torch.full((2,), scd.t_max)) and (times[0][2:] < scd.t_max).all()
    assert metrics["one_step_mse"] > 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)


def test_the_samplers_times_take_sCDs_own_loss_with_one_step_target_consistency(monkeypatch):
    """one_step_target=consistency: the first share at t_max and the next (two_step_frac) at mid_t, cycled, with no
    teacher ODE; the loss is sCD's at those times: equal to the loss of a run whose proposal drew them."""
    base = {"teacher": "unused", "warmup_steps": 0, "mid_t": (1.2, 0.6)}
    scd = SCD(**base, one_step_frac=0.25, one_step_target="consistency", two_step_frac=0.5)
    assert scd.target_ema_decay is None
    student, teacher = tiny_dit(seed=1), tiny_dit(seed=2)
    x, y = torch.randn(8, 3, 8, 8), torch.arange(8) % 4
    times = []
    scd.logvar.register_forward_hook(lambda module, args, out: times.append(args[0].clone()))
    scd.one_step_target = lambda *args: pytest.fail("the consistency target runs no teacher ODE")
    torch.manual_seed(0)
    loss, metrics = scd.loss(student, x, y, step=5, teacher=teacher)
    expected = torch.tensor([scd.t_max] * 2 + [1.2, 0.6, 1.2, 0.6])
    torch.testing.assert_close(times[0][:6], expected)
    assert (times[0][6:] < scd.t_max).all() and "one_step_mse" not in metrics

    plain = SCD(**base)
    plain.logvar.load_state_dict(scd.logvar.state_dict())
    drawn, original = times[0].clone(), distillation.lognormal_trigflow
    # the same draw (the same random stream after it), then the times the shares took
    monkeypatch.setattr(distillation, "lognormal_trigflow", lambda *args, **kwargs: (original(*args, **kwargs), drawn)[1])
    torch.manual_seed(0)
    plain_loss, _ = plain.loss(student, x, y, step=5, teacher=teacher)
    torch.testing.assert_close(loss, plain_loss)


@pytest.mark.parametrize("distilled", [SCD, RCM])
def test_one_step_ema_takes_the_targets_f_from_the_ema_network(distilled):
    """With one_step_ema the loop passes that EMA as `ema` (target_ema_decay), and the one-step target's f is its:
    the loss is the one whose target comes from `ema`, not the student's."""
    base = {"teacher": "unused", "one_step_frac": 0.5, "warmup_steps": 0, "teacher_steps": 2}
    scd = distilled(**base, one_step_ema=0.99)
    assert scd.target_ema_decay == 0.99 and distilled(**base).target_ema_decay is None
    assert distilled(teacher="unused", one_step_ema=0.99).target_ema_decay is None  # no one-step share, no target net
    student, teacher, ema = tiny_dit(seed=1), tiny_dit(seed=2), tiny_dit(seed=3)
    nets = {"teacher": teacher} | ({"fake_score": tiny_dit(seed=4)} if distilled is RCM else {})
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="one_step_ema=0.99 needs the model's EMA"):
        scd.loss(student, x, y, step=5, **nets)
    seen = []
    original = scd.one_step_target
    scd.one_step_target = lambda net, *args: seen.append(net) or original(net, *args)
    torch.manual_seed(0)
    scd.loss(student, x, y, step=5, ema=ema, **nets)
    assert seen == [ema]


def test_hf_weight_one_step_weighs_the_one_step_share_alone():
    """hf_weight_one_step on the batch's one-step samples, hf_weight on the rest: the loss is the sum of the two
    objectives' per-sample terms, each taken from the run that weighs that part alike."""
    student, teacher = tiny_dit(seed=1), tiny_dit(seed=2)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    seen = {}

    def per_sample(scd):
        original = scd.consistency_loss

        def spy(*args, **kwargs):
            seen[scd] = kwargs["hf_weight"]
            return original(*args, **kwargs)

        scd.consistency_loss = spy
        torch.manual_seed(0)
        return scd.loss(student, x, y, step=5, teacher=teacher)[0]

    base = {"teacher": "unused", "one_step_frac": 0.5, "teacher_steps": 2, "warmup_steps": 0, "hf_weight": 1.0}
    split = SCD(**base, hf_weight_one_step=16.0)
    per_sample(split)
    torch.testing.assert_close(seen[split], torch.tensor([16.0, 16.0, 1.0, 1.0]))
    alike = SCD(**base)
    per_sample(alike)
    assert seen[alike] == 1.0  # a number when every sample takes hf_weight
    assert per_sample(split) > per_sample(alike)  # the one-step samples' pixel-scale error counts 16 x, not 1 x


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hf_weight_one_step": 16.0}, "hf_weight_one_step=16.0 weighs the one_step_frac samples, and one_step_frac is 0"),
        ({"one_step_frac": 0.5, "hf_weight_one_step": -1.0}, "hf_weight must be a finite weight"),
        ({"one_step_frac": 1.5}, "one_step_frac must be a probability"),
        ({"one_step_frac": 0.5, "two_step_frac": 0.75}, "one_step_frac \\+ two_step_frac must be at most 1"),
        ({"one_step_target": "teacher"}, "one_step_target must be 'jump'"),
        ({"one_step_mid": 2.0}, "one_step_mid must lie in"),
        ({"one_step_mid": None}, "one_step_mid must lie in"),
        ({"teacher_steps": 0}, "teacher_steps must be an int >= 1"),
        ({"one_step_solver": "rk4"}, "one_step_solver must be 'euler' or 'heun'"),
        ({"one_step_ema": 1.0}, "one_step_ema must be an EMA decay"),
        ({"one_step_ema": "0.99"}, "one_step_ema must be an EMA decay"),
    ],
)
def test_bad_one_step_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SCD(teacher="t", **kwargs)


def test_the_boundary_term_regresses_f_on_the_teachers_x_prediction_below_boundary_time():
    """boundary_mse: the mean over the samples below boundary_time (flow-matching time) of ||f - f_teacher||^2 / D,
    f_teacher = cos t x_t - sin t dx_t/dt, the teacher's x-prediction; zero for a student equal to its teacher."""
    scd = SCD(teacher="unused", boundary_weight=2.0, boundary_time=0.3, warmup_steps=0)
    student, teacher = tiny_dit(seed=1), tiny_dit(seed=2)
    x_t, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    t = torch.tensor([0.05, 0.2, 0.9, 1.3])  # flow times 0.024, 0.092, 0.49, 0.89 at sigma_d 0.5: the first two inside
    assert (flow_time(t, scd.sigma_d) < 0.3).tolist() == [True, True, False, False]
    dx_t = scd.teacher_dxdt(teacher, x_t, t, y)
    base, _ = scd.consistency_loss(student, x_t, t, dx_t, y, step=5)
    loss, metrics = scd.consistency_loss(student, x_t, t, dx_t, y, step=5, boundary=scd.boundary(x_t, t, dx_t))
    with torch.no_grad():
        f = torch.stack([scd.consistency_fn(student, x_t[i : i + 1], t[i].item(), y[i : i + 1])[0] for i in range(4)])
        x_pred = torch.stack([scd.consistency_fn(teacher, x_t[i : i + 1], t[i].item(), y[i : i + 1])[0] for i in range(4)])
    expected = (f - x_pred)[:2].square().mean()
    torch.testing.assert_close(metrics["boundary_mse"], expected, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(loss, base + 2.0 * expected, rtol=1e-4, atol=1e-7)
    _, same = scd.consistency_loss(teacher, x_t, t, dx_t, y, step=5, boundary=scd.boundary(x_t, t, dx_t))
    assert same["boundary_mse"] < 1e-10
    assert SCD(teacher="unused").boundary(x_t, t, dx_t) is None  # off by default
    # with hf_weight the boundary is measured as the consistency term is: its pixel-scale part weighted alike
    weighted = SCD(teacher="unused", boundary_weight=2.0, boundary_time=0.3, warmup_steps=0, hf_weight=16.0)
    _, metrics = weighted.consistency_loss(student, x_t, t, dx_t, y, step=5, boundary=weighted.boundary(x_t, t, dx_t))
    diff = (f - x_pred)[:2]
    expected = (diff.square().flatten(1).sum(1) + 16.0 * high_pass(diff).square().flatten(1).sum(1)).mean() / diff[0].numel()
    torch.testing.assert_close(metrics["boundary_mse"], expected, rtol=1e-4, atol=1e-7)


def test_a_data_predicting_student_needs_the_boundary_term():
    from flm.train.settings import check_prediction

    with pytest.raises(ValueError, match="objective.boundary_weight > 0 with objective.adaptive_weighting=false"):
        check_prediction(SCD(teacher="t"), "data")
    assert "data" in SCD(teacher="t", boundary_weight=1.0, adaptive_weighting=False).predictions
    assert "data" not in SCD(teacher="t", boundary_weight=1.0).predictions and "data" not in SCD.predictions
    with pytest.raises(ValueError, match="boundary_weight must be a number >= 0"):
        SCD(teacher="t", boundary_weight=-1.0)
    with pytest.raises(ValueError, match="boundary_time must be a flow-matching time in"):
        SCD(teacher="t", boundary_time=0.0)


def test_a_given_phase_is_the_only_one_asked_for(monkeypatch):
    """Under CUDA graphs the loop passes each step's phase and the step as a device tensor, whose phase(step) would read
    it on the host (a sync a capture refuses): MeanFlow + DMD's student step must not ask its phase again, through
    MeanFlow's loss (whose consistency curriculum has phases of its own) included."""
    objective = MeanFlowDMD(teacher="unused", dmd_weight=1.0)
    student = tiny_dit(time_inputs=objective.time_inputs, seed=1)
    teacher, fake = tiny_dit(seed=2).requires_grad_(False), tiny_dit(seed=3)

    def no_host_read(step):
        raise AssertionError("phase(step) called although the step's phase was given")

    monkeypatch.setattr(objective, "phase", no_host_read)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    losses, _ = objective.loss(student, x, y, step=torch.tensor(3), phase="model", teacher=teacher, fake_score=fake)
    assert list(losses) == ["model"]


def test_a_teachers_matmul_weights_in_bf16_give_its_autocast_outputs_to_the_bit_without_casts():
    """flm.objectives.teacher.matmuls_in_bf16: the linear layers' weights stored in bf16 are the values bf16 autocast
    casts them to, so the teacher's velocity and hidden states are the same to the bit; the loss's cast cache then
    casts none of them (it cast every one before), and the float32 embeddings stay as they were."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flm import nn as fnn
    from flm.objectives.teacher import matmuls_in_bf16

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket is torch.ops.aten._to_copy and isinstance(args[0], torch.nn.Parameter)
            return func(*args, **(kwargs or {}))

    teacher = tiny_dit().eval().requires_grad_(False)
    stored = matmuls_in_bf16(copy.deepcopy(teacher))
    linears = [m for m in stored.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == m.bias.dtype == torch.bfloat16 for m in linears)
    assert stored.y_embedder.weight.dtype == torch.float32
    x, t, y = torch.randn(4, 3, 8, 8), torch.rand(4), torch.tensor([0, 3, 10, 7])
    outputs = []
    for net in (teacher, stored):
        with torch.autocast("cpu", dtype=torch.bfloat16), fnn.cast_cache(), Casts() as casts:
            outputs.append((net(x, t, None, y), net(x, t, None, y, features=[0, 1]), casts.count))
    (v, h, casts_before), (v_stored, h_stored, casts_after) = outputs
    assert torch.equal(v, v_stored) and all(torch.equal(a, b) for a, b in zip(h, h_stored))
    assert casts_before >= len(linears) and casts_after == 0
