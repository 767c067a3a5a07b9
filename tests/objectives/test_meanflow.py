"""MeanFlow: the loss at the exact average velocity, its target in closed form, the sampler.

python -m pytest tests/objectives/test_meanflow.py -q
"""

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad

from flm.objectives import MeanFlow
from flm.objectives.guidance import drop_labels
from flm.objectives.frequency import squared_error
from flm.objectives.paths import LinearPath
from flm.objectives.teacher import teacher_velocity
from tests.models.tiny import tiny_dit
from tests.objectives.curriculum import gradient_distances
from tests.objectives.toys import PointMassMeanFlow, PointMassVelocity

A = 0.7


def _data(n=64):
    return torch.full((n, 1, 2, 2), A)


@pytest.mark.parametrize("jvp_mode", ["dual", "two_pass", "func"])
def test_loss_is_zero_at_the_exact_average_velocity(jvp_mode):
    # du/dt = v / t - (z - a) / t^2 vanishes only if both tangents (v for z, 1 for t) are right
    torch.manual_seed(0)
    _, metrics = MeanFlow(r_neq_t=1.0, jvp_mode=jvp_mode).loss(PointMassMeanFlow(A), _data())
    assert metrics["mse"] < 1e-10


@pytest.mark.parametrize("jvp_mode", ["dual", "two_pass", "func"])
def test_target_away_from_the_solution(jvp_mode):
    """u = (z - a)/t + c t: u - u_tgt = c (2t - r), so loss = D c^2 mean((2t - r)^2) with p = 0."""
    c, x = 0.3, _data()
    objective = MeanFlow(r_neq_t=0.5, adaptive_p=0.0, jvp_mode=jvp_mode)
    torch.manual_seed(1)
    loss, _ = objective.loss(PointMassMeanFlow(A, offset=c), x)
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    assert (r < t).any() and (r == t).any()
    torch.testing.assert_close(loss, 4 * c**2 * ((2 * t - r) ** 2).mean(), rtol=1e-4, atol=0)


class _RMeanFlow(PointMassMeanFlow):
    """u = (z - a)/t + c r: a flow map of its own diagonal velocity u(x, r, r) = (x - a)/r + c r, with du/dr = c."""

    def forward(self, x, t, r=None, y=None):
        return (x - self.a) / t.reshape(-1, 1, 1, 1) + self.offset * r.reshape(-1, 1, 1, 1)


@pytest.mark.parametrize("jvp_mode", ["dual", "two_pass", "func"])
def test_lagrangian_identity_is_exact_for_the_flow_of_its_own_velocity(jvp_mode):
    """Without a teacher the end point X = z - (t - r) u moves with the model's own sg(u(X, r, r)): zero error for
    u = (z - a)/t + c r, whose du/dr = c the target needs (without it the error would be c (t - r))."""
    torch.manual_seed(0)
    objective = MeanFlow(r_neq_t=1.0, adaptive_p=0.0, identity="lagrangian", jvp_mode=jvp_mode)
    _, metrics = objective.loss(_RMeanFlow(A, offset=0.3), _data())
    assert metrics["mse"] < 1e-10


@pytest.mark.parametrize("jvp_subset", [True, False])
def test_lagrangian_self_distillation_anchors_its_diagonal_on_the_data(jvp_subset):
    """Without a teacher the r = t samples learn the data's v by flow matching: u = (z - a)/t + c r meets the r != t
    target exactly (its own flow map) but is off the data's velocity (z - a)/t by c t on the diagonal, so the loss is
    D c^2 mean(t^2 [r = t]) at p = 0, from the plain forwards (jvp_subset) and inside the JVP's batch alike. Before,
    the diagonal's target was the model's own output and this loss was 0: nothing tied the field to the data."""
    c, x = 0.3, _data()
    objective = MeanFlow(r_neq_t=0.5, adaptive_p=0.0, identity="lagrangian", jvp_subset=jvp_subset)
    torch.manual_seed(1)
    loss, _ = objective.loss(_RMeanFlow(A, offset=c), x)
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    assert (t == r).any() and (t != r).any()
    torch.testing.assert_close(loss, 4 * c**2 * (t**2 * (t == r)).mean(), rtol=1e-4, atol=0)


class _LabelledRMeanFlow(_RMeanFlow):
    """_RMeanFlow with classes; the null class's output is off by a further k t, so guidance moves the target."""

    num_classes = 3

    def forward(self, x, t, r=None, y=None):
        return super().forward(x, t, r, y) + self.k * t.reshape(-1, 1, 1, 1) * (y == 3).reshape(-1, 1, 1, 1)


def test_lagrangian_self_distillation_takes_guidance_in_training_on_its_diagonal():
    """With cfg_omega w the diagonal's target is the guided v~ = w v + (1 - w) u(z, t, t | null): for the model above
    u(., null) - v = (c + k) t, so a labelled sample's error is c t - (1 - w)(c + k) t; a dropped label's is its own
    output's, (c + k) t, against v."""
    c, k, w = 0.3, 0.5, 2.0
    model = _LabelledRMeanFlow(A, offset=c)
    model.k = k
    objective = MeanFlow(r_neq_t=0.0, adaptive_p=0.0, identity="lagrangian", cfg_omega=w, label_dropout=0.0)
    x, y = _data(), torch.arange(64) % 3
    t, r, err = objective.errors(model, x, y)
    assert (t == r).all()
    expected = (c * t - (1 - w) * (c + k) * t).reshape(-1, 1, 1, 1).expand_as(err)
    torch.testing.assert_close(err, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jvp_mode", ["dual", "two_pass", "func"])
def test_lagrangian_identity_with_a_teacher(jvp_mode):
    """Teacher v = (z - a)/t + k, student u = (z - a)/t + c r: X - a = (z - a) r/t - (t - r) c r, so
    u_tgt = v(X, r) + (t - r) c = (z - a)/t + k and u - u_tgt = c r - k; loss = D mean((c r - k)^2) at p = 0."""
    c, k, x = 0.3, 0.2, _data()
    objective = MeanFlow(teacher="unused", r_neq_t=1.0, adaptive_p=0.0, identity="lagrangian", jvp_mode=jvp_mode)
    torch.manual_seed(1)
    loss, _ = objective.loss(_RMeanFlow(A, offset=c), x, teacher=PointMassVelocity(A, offset=k))
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    torch.testing.assert_close(loss, 4 * ((c * r - k) ** 2).mean(), rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"identity": "hamiltonian"}, "valid identities: eulerian, lagrangian"),
        ({"identity": "lagrangian", "tangent": "model"}, "set objective.tangent=sample"),
        ({"identity": "lagrangian", "cfg_omega": 2.0, "teacher": "unused"}, "identity=lagrangian with a teacher"),
        ({"identity": "lagrangian"}, "identity=lagrangian without a teacher .* adaptive_p=1.0"),
        ({"identity": "lagrangian", "adaptive_p": 0.5}, "set objective.adaptive_p=0"),
    ],
)
def test_identity_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeanFlow(**kwargs)


def test_split_target_is_exact_at_the_solution():
    torch.manual_seed(0)
    _, metrics = MeanFlow(r_neq_t=1.0, split_above=0.0, split_frac=1.0).loss(PointMassMeanFlow(A), _data())
    assert metrics["mse"] < 1e-10


def test_split_target_away_from_the_solution():
    """u = (z - a)/t + c t. Two half jumps through s = (t + r)/2 give u_tgt = (z - a)/t + c (t + s - t (t - s) / s) / 2,
    so u - u_tgt = c (t - r)(s + t) / (4 s) on the split intervals (the batch's longest quarter, if above 0.3) and
    c (2t - r) (the identity's) on the others."""
    c, x = 0.3, _data()
    objective = MeanFlow(r_neq_t=1.0, adaptive_p=0.0, split_above=0.3, split_frac=0.25)
    torch.manual_seed(1)
    loss, _ = objective.loss(PointMassMeanFlow(A, offset=c), x)
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    s = (t + r) / 2
    longest = torch.zeros_like(t, dtype=torch.bool)
    longest[torch.topk(t - r, 16).indices] = True  # 0.25 of 64
    split = longest & (t - r > 0.3)
    assert split.any() and ((t - r > 0.3) & ~longest).any()  # the cap binds: some long intervals keep the identity
    err = torch.where(split, c * (t - r) * (s + t) / (4 * s), c * (2 * t - r))
    torch.testing.assert_close(loss, 4 * (err**2).mean(), rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match="split_above must be an interval length"):
        MeanFlow(split_above=1.0)
    with pytest.raises(ValueError, match="split_frac must be a fraction"):
        MeanFlow(split_above=0.5, split_frac=0.0)


def test_uniform_split_point_away_from_the_solution():
    """u = (z - a)/t + c t, split at s = t - lam (t - r), lam uniform: u_tgt = lam u(z_t, s, t) + (1 - lam) u(z_s, r, s)
    gives u - u_tgt = c (1 - lam)(t - s)(s + t) / s on the split intervals (the midpoint's at lam = 1/2), c (2t - r)
    on the others; lam is drawn after the path's noise, one per selected sample in topk's order."""
    c, x = 0.3, _data()
    objective = MeanFlow(r_neq_t=1.0, adaptive_p=0.0, split_above=0.3, split_frac=0.25, split_point="uniform")
    torch.manual_seed(1)
    t, r, err = objective.errors(PointMassMeanFlow(A, offset=c), x)
    torch.manual_seed(1)  # the draws of errors(), in its order
    objective.sample_times(x.shape[0], x.device)
    torch.randn_like(x)
    i = torch.topk(t - r, 16).indices  # 0.25 of 64
    lam = torch.full_like(t, 0.5)
    lam[i] = torch.rand(16)
    s = t - lam * (t - r)
    split = torch.zeros_like(t, dtype=torch.bool)
    split[i] = t[i] - r[i] > 0.3
    assert split.any() and (lam[split] - 0.5).abs().max() > 0.1  # not the midpoint
    expected = torch.where(split, c * (1 - lam) * (t - s) * (s + t) / s, c * (2 * t - r))
    torch.testing.assert_close(err, expected[:, None, None, None].expand_as(err), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="valid split points: mid, uniform"):
        MeanFlow(split_above=0.5, split_point="random")


@pytest.mark.parametrize("steps", [1, 3])
def test_teacher_split_target_is_the_teachers_euler_solution(steps):
    """Teacher v = (z - a)/t + c, student u = (z - a)/t. K Euler steps of h = (t - r)/K from t to r keep
    w = (z - a)/t up to w_{k+1} = w_k - h c / t_{k+1}, so u_tgt = (z_t - z_r)/(t - r) = (z - a)/t + (r c / K) sum_k 1/t_k
    (t_k = t - k h) on the split intervals; the others keep the identity's u_tgt = (z - a)/t + c r / t."""
    c, x = 0.3, _data()
    split = dict(split_above=0.3, split_frac=0.25, split_target="teacher", teacher_steps=steps)
    objective = MeanFlow(teacher="unused", r_neq_t=1.0, adaptive_p=0.0, **split)
    torch.manual_seed(1)
    loss, _ = objective.loss(PointMassMeanFlow(A), x, teacher=PointMassVelocity(A, offset=c))
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    longest = torch.zeros_like(t, dtype=torch.bool)
    longest[torch.topk(t - r, 16).indices] = True  # 0.25 of 64
    split = longest & (t - r > 0.3)
    assert split.any() and ((t - r > 0.3) & ~longest).any()
    t_k = t[:, None] - torch.arange(1, steps + 1) * ((t - r) / steps)[:, None]
    err = torch.where(split, -r * c * (1 / t_k).mean(1), -c * r / t)
    torch.testing.assert_close(loss, 4 * (err**2).mean(), rtol=1e-4, atol=0)


def test_teacher_split_target_with_guidance_leaves_the_other_samples_alone():
    """A tiny DiT teacher with its guidance: the selected samples' u - u_tgt against an explicit Euler loop of
    teacher_velocity (the identity target's velocity), the others' error as without the split target."""
    student, teacher = tiny_dit(time_inputs=2, seed=1), tiny_dit(seed=2).requires_grad_(False)
    x, y = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8)
    kwargs = dict(teacher="unused", teacher_cfg_scale=1.5, r_neq_t=1.0, label_dropout=0.5)
    objective = MeanFlow(**kwargs, split_above=0.0, split_frac=0.25, split_target="teacher", teacher_steps=3)
    torch.manual_seed(1)
    t, r, err = objective.errors(student, x, y, teacher=teacher)
    torch.manual_seed(1)
    _, _, err_identity = MeanFlow(**kwargs).errors(student, x, y, teacher=teacher)
    torch.manual_seed(1)  # the draws of errors(), in its order
    y_in = drop_labels(student, y, 0.5)
    objective.sample_times(8, "cpu")
    z = LinearPath().sample(x, torch.randn_like(x), t).x_t
    i = torch.topk(t - r, 2).indices
    z_k, h = z[i], (t[i] - r[i]) / 3
    for k in range(3):
        v = teacher_velocity(teacher, z_k, t[i] - k * h, y_in[i], 1.5)
        z_k = z_k - h[:, None, None, None] * v
    u_tgt = (z[i] - z_k) / (t[i] - r[i])[:, None, None, None]
    with torch.no_grad():
        u = student(z[i], t[i], r[i], y_in[i])
    torch.testing.assert_close(err[i], u - u_tgt, rtol=1e-4, atol=1e-5)
    others = torch.ones(8, dtype=torch.bool)
    others[i] = False
    torch.testing.assert_close(err[others], err_identity[others], rtol=0, atol=0)
    assert (err[i] - err_identity[i]).abs().max() > 1e-3


def test_teacher_student_split_target_is_the_teachers_first_jump_then_the_students():
    """split_target=teacher_student: z_s from teacher_steps Euler steps of the teacher over [s, t] (s the midpoint),
    then the student's jump u(z_s, r, s); u_tgt is the two jumps' mean velocity, on the selected samples only."""
    student, teacher = tiny_dit(time_inputs=2, seed=1), tiny_dit(seed=2).requires_grad_(False)
    x, y = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8)
    kwargs = dict(teacher="unused", r_neq_t=1.0, label_dropout=0.0)
    objective = MeanFlow(**kwargs, split_above=0.0, split_frac=0.25, split_target="teacher_student", teacher_steps=2)
    torch.manual_seed(1)
    t, r, err = objective.errors(student, x, y, teacher=teacher)
    torch.manual_seed(1)  # the draws of errors(), in its order
    objective.sample_times(8, "cpu")
    z = LinearPath().sample(x, torch.randn_like(x), t).x_t
    i = torch.topk(t - r, 2).indices
    t_i, r_i = t[i], r[i]
    s_i = (t_i + r_i) / 2
    z_k, h = z[i], (t_i - s_i) / 2
    for k in range(2):
        z_k = z_k - h[:, None, None, None] * teacher_velocity(teacher, z_k, t_i - k * h, y[i], 1.0)
    with torch.no_grad():
        u_sr = student(z_k, s_i, r_i, y[i])
        u_tgt = ((z[i] - z_k) + (s_i - r_i)[:, None, None, None] * u_sr) / (t_i - r_i)[:, None, None, None]
        u = student(z[i], t_i, r_i, y[i])
    torch.testing.assert_close(err[i], u - u_tgt, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="split_target=teacher_student needs objective.teacher"):
        MeanFlow(split_above=0.5, split_target="teacher_student")


def test_ema_split_target_takes_the_half_jumps_of_the_ema():
    """split_target=ema: the selected samples' target is the student split target computed with the EMA network
    (another tiny DiT), the others' as without the split target; no EMA passed is a clear error."""
    student, ema = tiny_dit(time_inputs=2, seed=1), tiny_dit(time_inputs=2, seed=3).requires_grad_(False)
    x, y = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.arange(8)
    split = dict(split_above=0.0, split_frac=0.25, r_neq_t=1.0)
    torch.manual_seed(1)
    t, r, err = MeanFlow(**split, split_target="ema").errors(student, x, y, ema=ema)
    torch.manual_seed(1)
    _, _, err_identity = MeanFlow(r_neq_t=1.0).errors(student, x, y)
    torch.manual_seed(1)
    _, _, err_student_split = MeanFlow(**split).errors(student, x, y)
    i = torch.topk(t - r, 2).indices
    others = torch.ones(8, dtype=torch.bool)
    others[i] = False
    torch.testing.assert_close(err[others], err_identity[others], rtol=0, atol=0)
    torch.manual_seed(1)  # the draws of errors(), in its order
    objective = MeanFlow(**split, split_target="ema")
    y_in = drop_labels(student, y, objective.label_dropout)
    objective.sample_times(8, "cpu")
    z = LinearPath().sample(x, torch.randn_like(x), t).x_t
    with torch.no_grad():
        u = student(z[i], t[i], r[i], y_in[i])
    torch.testing.assert_close(err[i], u - objective._split_target(ema, z[i], t[i], r[i], y_in[i]), rtol=1e-4, atol=1e-5)
    assert (err[i] - err_student_split[i]).abs().max() > 1e-3  # the EMA's jumps, not the student's
    with pytest.raises(ValueError, match="needs the model's EMA at decay 0.99"):
        objective.errors(student, x, y)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"split_above": 0.5, "split_target": "shortcut"}, "valid split targets: student, ema, teacher"),
        ({"split_above": 0.5, "split_target": "teacher"}, "split_target=teacher needs objective.teacher"),
        ({"teacher": "t", "split_target": "teacher"}, "and objective.split_above"),
        ({"teacher_steps": 0}, "teacher_steps must be an int >= 1"),
        ({"teacher_steps": 2.5}, "teacher_steps must be an int >= 1"),
        ({"teacher_steps": True}, "teacher_steps must be an int >= 1"),
        ({"split_target": "ema"}, "split_target=ema needs objective.split_above"),
        ({"split_above": 0.5, "split_target": "ema", "split_ema": 1.0}, r"split_ema must be an EMA decay in \(0, 1\)"),
    ],
)
def test_split_target_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeanFlow(**kwargs)


def test_model_tangent_away_from_the_solution():
    """tangent="model" puts u(z, t, t) = v + c t into the JVP: du/dt = 2c, u - u_tgt = c (3t - 2r)."""
    c, x = 0.3, _data()
    objective = MeanFlow(r_neq_t=0.5, adaptive_p=0.0, tangent="model")
    torch.manual_seed(1)
    loss, _ = objective.loss(PointMassMeanFlow(A, offset=c), x)
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    torch.testing.assert_close(loss, 4 * c**2 * ((3 * t - 2 * r) ** 2).mean(), rtol=1e-4, atol=0)
    _, metrics = MeanFlow(r_neq_t=1.0, tangent="model").loss(PointMassMeanFlow(A), x)
    assert metrics["mse"] < 1e-10
    with pytest.raises(ValueError, match="valid tangents: sample, model"):
        MeanFlow(tangent="u")


@pytest.mark.parametrize(("tangent", "slope"), [("model", 2.0), ("sample", 1.0)])
def test_target_velocity_model_takes_the_models_own_velocity_where_r_differs_from_t(tangent, slope):
    """u = (z - a)/t + c t, so u(z, t, t) = v + c t and du/dt = slope c (2c along the model tangent, c along v): with
    the model's velocity in the target, u - u_tgt = slope c (t - r) where r != t; r = t keeps v: u - v = c t."""
    c, x = 0.3, _data()
    objective = MeanFlow(r_neq_t=0.5, adaptive_p=0.0, tangent=tangent, target_velocity="model")
    torch.manual_seed(1)
    loss, _ = objective.loss(PointMassMeanFlow(A, offset=c), x)
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    err = torch.where(r != t, slope * c * (t - r), c * t)
    torch.testing.assert_close(loss, 4 * (err**2).mean(), rtol=1e-4, atol=0)
    _, metrics = MeanFlow(r_neq_t=1.0, target_velocity="model", adaptive_p=0.0).loss(PointMassMeanFlow(A), x)
    assert metrics["mse"] < 1e-10  # the exact average velocity stays a fixed point


def test_target_velocity_ema_takes_the_velocity_of_the_target_network():
    """The EMA's u(z, t, t) = v + c' t in the target, the model's tangent (du/dt = 2c): u - u_tgt = (c - c') t + 2c (t - r)
    where r != t."""
    c, c_ema, x = 0.3, 0.1, _data()
    objective = MeanFlow(r_neq_t=0.5, adaptive_p=0.0, tangent="model", target_velocity="ema", split_ema=0.9)
    assert objective.target_ema_decay == 0.9  # the loop hands the loss this EMA
    torch.manual_seed(1)
    loss, _ = objective.loss(PointMassMeanFlow(A, offset=c), x, ema=PointMassMeanFlow(A, offset=c_ema))
    torch.manual_seed(1)
    t, r = objective.sample_times(x.shape[0], x.device)
    err = torch.where(r != t, (c - c_ema) * t + 2 * c * (t - r), c * t)
    torch.testing.assert_close(loss, 4 * (err**2).mean(), rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match="objective.target_velocity=ema needs the model's EMA at decay 0.9"):
        objective.loss(PointMassMeanFlow(A, offset=c), x)


def test_target_velocity_model_refuses_a_teacher_the_lagrangian_identity_and_p_1():
    with pytest.raises(ValueError, match="valid: sample, model, ema"):
        MeanFlow(target_velocity="teacher")
    with pytest.raises(ValueError, match="target_velocity=model puts the model's own velocity"):
        MeanFlow(target_velocity="model", identity="lagrangian", adaptive_p=0.0)
    with pytest.raises(ValueError, match="target_velocity=model puts the model's own velocity"):
        MeanFlow(target_velocity="model", teacher="runs/fm", adaptive_p=0.0)
    for p in (1.0, 0.5):  # the collapses measured on the CPU run
        with pytest.raises(ValueError, match="set objective.adaptive_p=0"):
            MeanFlow(target_velocity="ema", adaptive_p=p)
    MeanFlow(target_velocity="ema", adaptive_p=0.25)


def test_sample_times():
    torch.manual_seed(0)
    t, r = MeanFlow(r_neq_t=0.25).sample_times(20000, "cpu")
    assert (t >= r).all() and r.min() > 0 and t.max() < 1
    torch.testing.assert_close((r != t).float().mean(), torch.tensor(0.25), atol=0.02, rtol=0)


def test_sample_times_r_zero():
    """r_zero puts that fraction at r = 0 whatever r_neq_t; the rest keep the two-draw proposal, and t is untouched."""
    torch.manual_seed(0)
    t0, _ = MeanFlow(r_neq_t=0.0).sample_times(20000, "cpu")
    torch.manual_seed(0)
    t, r = MeanFlow(r_neq_t=0.0, r_zero=0.4).sample_times(20000, "cpu")
    torch.testing.assert_close(t, t0)
    zero = r == 0
    torch.testing.assert_close(zero.float().mean(), torch.tensor(0.4), atol=0.02, rtol=0)
    assert (r[~zero] == t[~zero]).all()
    with pytest.raises(ValueError, match="r_zero must be a probability"):
        MeanFlow(r_zero=-0.1)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_interval_warmup_shortens_the_intervals_then_lets_them_be(as_tensor):
    """interval_warmup scales each r != t interval by min(1, step / interval_warmup) from the same draws; t, the r = t
    samples and the samplers' intervals stay; a tensor step (a CUDA-graph step's) gives the same times."""

    def times(step, **kwargs):
        torch.manual_seed(0)
        step = torch.tensor(step) if as_tensor and step is not None else step
        return MeanFlow(r_neq_t=0.5, jvp_subset=True, one_step_frac=0.125, **kwargs).sample_times(64, "cpu", step)

    t0, r0 = times(None)
    assert (t0[8:36] > r0[8:36]).all() and (t0[36:] == r0[36:]).all()  # 8 + round(0.5 x 56) take r != t
    for step, scale in [(0, 0.0), (250, 0.25), (1000, 1.0), (5000, 1.0)]:
        t, r = times(step, interval_warmup=1000)
        torch.testing.assert_close(t, t0)
        torch.testing.assert_close(t[8:] - r[8:], scale * (t0[8:] - r0[8:]))
        assert (t[:8] == 1).all() and (r[:8] == 0).all()
    torch.testing.assert_close(times(250), (t0, r0))  # off by default
    torch.testing.assert_close(times(None, interval_warmup=1000), (t0, r0))  # no step (evaluation): the full proposal


class _GapMeanFlow(PointMassMeanFlow):
    """u = (z - a)/t + c (t - r): the exact velocity at r = t, an error 2 c (t - r) against the identity's target elsewhere."""

    def forward(self, x, t, r=None, y=None):
        return (x - self.a) / t.reshape(-1, 1, 1, 1) + self.offset * (t - r).reshape(-1, 1, 1, 1)


def test_interval_warmup_starts_as_flow_matching():
    """At step 0 every interval is empty, so the loss is the velocity's alone: zero for a model whose velocity is exact
    and whose longer intervals are not, which the full intervals charge for."""
    torch.manual_seed(0)
    model, x = _GapMeanFlow(A, offset=0.3), _data()
    objective = MeanFlow(r_neq_t=1.0, adaptive_p=0.0, interval_warmup=100)
    _, start = objective.loss(model, x, step=0)
    _, done = objective.loss(model, x, step=100)
    assert start["mse"] < 1e-10 < done["mse"]
    with pytest.raises(ValueError, match="interval_warmup must be a number of steps >= 0"):
        MeanFlow(interval_warmup=-1)


@pytest.mark.parametrize(("mid_t", "s"), [((), 0.5), ((0.6,), 0.6)])
def test_sample_times_one_and_two_step_fracs(mid_t, s):
    """one_step_frac puts a fixed count, the batch's first samples, at (r, t) = (0, 1); two_step_frac the next ones at
    the 2-step sampler's (s, 1) and (0, s) in turn; the others' draws stay as they were."""
    torch.manual_seed(0)
    t0, r0 = MeanFlow(r_neq_t=0.5).sample_times(64, "cpu")
    torch.manual_seed(0)
    t, r = MeanFlow(r_neq_t=0.5, one_step_frac=0.1, two_step_frac=0.125, mid_t=mid_t).sample_times(64, "cpu")
    assert (t[:6] == 1).all() and (r[:6] == 0).all()
    torch.testing.assert_close(t[6:14], torch.tensor([1.0, s] * 4))
    torch.testing.assert_close(r[6:14], torch.tensor([s, 0.0] * 4))
    torch.testing.assert_close((t[14:], r[14:]), (t0[14:], r0[14:]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"one_step_frac": 1.5}, "one_step_frac must be a probability"),
        ({"two_step_frac": -0.1}, "two_step_frac must be a probability"),
        ({"one_step_frac": 0.6, "two_step_frac": 0.5}, "one_step_frac \\+ two_step_frac must be at most 1"),
    ],
)
def test_sampler_interval_fracs_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeanFlow(**kwargs)


def test_one_step_samples_take_the_models_two_step_sample_as_target():
    """u = (z - a)/t + c t. On (r, t) = (0, 1) the split target is the 2-step sampler's average velocity,
    z_1 - MeanFlow.sample(steps=2), so u - u_tgt = c (1 - r)(s + 1) / (4 s) = 3c/4 at s = 1/2 there."""
    c, x = 0.3, _data()
    model = PointMassMeanFlow(A, offset=c)
    objective = MeanFlow(r_neq_t=1.0, adaptive_p=0.0, split_above=0.5, split_frac=0.125, one_step_frac=0.125)
    torch.manual_seed(1)
    t, r, err = objective.errors(model, x)
    torch.manual_seed(1)
    objective.sample_times(x.shape[0], x.device)
    z = torch.randn_like(x)
    u_2step = z - objective.sample(model, z, steps=2)
    with torch.no_grad():
        u = model(z, t, r)
    torch.testing.assert_close(err[:8], (u - u_2step)[:8], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(err[:8], torch.full_like(err[:8], 0.75 * c), rtol=1e-4, atol=1e-6)


def test_adaptive_weight_gradient():
    """Gradient of sg(w) ||err||^2 is w * grad ||err||^2 with w = 1 / (||err||^2 + c)^p; the
    gradient reaches u only (u_tgt has a stop-gradient): d err / d offset = t, not 2t - r."""
    model, x = PointMassMeanFlow(A, offset=0.3), _data(8)
    torch.manual_seed(2)
    loss, metrics = MeanFlow(r_neq_t=1.0, adaptive_p=1.0).loss(model, x)
    (g,) = torch.autograd.grad(loss, model.offset)
    torch.manual_seed(2)
    t, r = MeanFlow(r_neq_t=1.0).sample_times(8, "cpu")
    sq = 4 * (0.3 * (2 * t - r)) ** 2  # ||err||^2 per sample
    expected = (2 * 4 * 0.3 * (2 * t - r) * t / (sq + 1e-3)).mean()
    torch.testing.assert_close(g, expected, rtol=1e-4, atol=0)
    assert loss < 1.0  # sq / (sq + c) per sample


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_sampler_with_the_exact_average_velocity_lands_on_the_data(steps):
    noise = torch.randn(16, 1, 2, 2)
    x = MeanFlow().sample(PointMassMeanFlow(A), noise, steps=steps)
    torch.testing.assert_close(x, torch.full_like(x, A))
    away = MeanFlow().sample(PointMassMeanFlow(A, offset=0.3), noise, steps=steps)
    assert (away - A).abs().min() > 1e-3


def test_guidance_in_training_keeps_the_exact_solution():
    """With point-mass data the null-class u is the exact v too, so v~ = v and the loss stays ~0
    for any omega, kappa (a wrong mix of v and u would not)."""
    model = PointMassMeanFlow(A)
    model.num_classes = 3
    torch.manual_seed(3)
    _, metrics = MeanFlow(r_neq_t=1.0, cfg_omega=2.0, cfg_kappa=0.5).loss(model, _data(), torch.randint(0, 3, (64,)))
    assert metrics["mse"] < 1e-10


def test_hf_weight_adds_the_pixel_scale_part_of_the_error():
    """A spatially constant error has no high-pass part, so hf_weight leaves the loss alone (the squared error itself:
    tests/objectives/test_frequency.py)."""
    model, x = PointMassMeanFlow(A, offset=0.3), _data()
    losses = []
    for w in (0.0, 5.0):
        torch.manual_seed(1)
        losses.append(MeanFlow(r_neq_t=0.5, adaptive_p=0.0, hf_weight=w).loss(model, x)[0])
    torch.testing.assert_close(losses[0], losses[1])


def test_hf_weight_config_error():
    with pytest.raises(ValueError, match="hf_weight"):
        MeanFlow(hf_weight=-1.0)


def test_hf_weight_one_step_weighs_the_one_step_samples_alone(monkeypatch):
    objective = MeanFlow(one_step_frac=0.25, hf_weight=256.0, hf_weight_one_step=16.0, adaptive_p=0.0)
    assert objective.hf_weights(8, "cpu").tolist() == [16.0, 16.0] + [256.0] * 6
    assert MeanFlow(one_step_frac=0.25, hf_weight=4.0).hf_weights(8, "cpu") == 4.0
    err = torch.randn(8, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(objective, "_errors", lambda *a, **k: (None, None, err, None, None))
    loss, _ = objective.loss(None, torch.zeros(8, 1, 6, 6))
    per_sample = [squared_error(err[i : i + 1], 16.0 if i < 2 else 256.0) for i in range(8)]
    torch.testing.assert_close(loss, torch.cat(per_sample).mean())
    assert not torch.allclose(loss, squared_error(err, 256.0).mean())  # the one-step samples did take 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hf_weight_one_step": 16.0}, "set objective.one_step_frac > 0 or objective.hf_weight_one_step=null"),
        ({"hf_weight_one_step": -1.0, "one_step_frac": 0.1}, "hf_weight must be a finite weight >= 0"),
    ],
)
def test_hf_weight_one_step_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeanFlow(**kwargs)


def test_the_perceptual_term_measures_the_one_step_samples_in_the_teachers_features():
    kwargs = dict(teacher="unused", r_neq_t=1.0, label_dropout=0.0, one_step_frac=0.5, tangent="sample")
    student, teacher = tiny_dit(time_inputs=2, seed=1), tiny_dit(seed=2).requires_grad_(False)
    x, y = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 3, 7, 9])
    objective = MeanFlow(perceptual_weight=0.7, perceptual_t=0.2, **kwargs)
    torch.manual_seed(1)
    loss, metrics = objective.loss(student, x, y, teacher=teacher)

    # by hand, with the same draws: the MeanFlow term's, then one noise for the perceptual term
    torch.manual_seed(1)
    t, r, err, z, u = objective._errors(student, x, y, teacher=teacher)
    assert torch.equal(t[:2], torch.ones(2)) and torch.equal(r[:2], torch.zeros(2))  # the one-step samples
    eps = torch.randn(2, 3, 8, 8)
    x_g = z[:2] - u[:2]
    feats = [teacher(0.8 * im + 0.2 * eps, torch.full((2,), 0.2), None, y[:2], features=(0, 1)) for im in (x_g, x_g + err[:2])]
    d = sum((a - b.detach()).square().flatten(1).mean(1) for a, b in zip(*feats))
    sq = err.square().flatten(1).sum(1) + torch.cat([0.7 * d, torch.zeros(2)])  # d a part of the one-step errors
    direct = (sq / (sq.detach() + 1e-3)).mean()
    torch.testing.assert_close(loss, direct, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["perceptual"], d.detach().mean(), rtol=1e-5, atol=1e-7)
    params = list(student.parameters())
    for g, g_ref in zip(
        torch.autograd.grad(loss, params, allow_unused=True), torch.autograd.grad(direct, params, allow_unused=True)
    ):
        if g_ref is not None:
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"perceptual_weight": 1.0, "one_step_frac": 0.1}, "needs objective.teacher and objective.one_step_frac > 0"),
        ({"perceptual_weight": 1.0, "teacher": "unused"}, "needs objective.teacher and objective.one_step_frac > 0"),
        ({"perceptual_weight": -1.0}, "perceptual_weight must be a finite weight >= 0"),
        ({"perceptual_t": 1.0}, r"perceptual_t a time in \[0, 1\)"),
    ],
)
def test_perceptual_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeanFlow(**kwargs)


def _fixed_times(objective, t, r):
    """objective with its proposal replaced by the times (t, r)."""
    objective.sample_times = lambda n, device, step=None: (t, r)
    return objective


@pytest.mark.parametrize(
    "kwargs",
    [
        {"jvp_mode": "dual"},
        {"jvp_mode": "two_pass", "tangent": "model"},
        {"jvp_mode": "func", "tangent": "model"},
        {"jvp_mode": "dual", "tangent": "model", "cfg_omega": 2.0},
        {"jvp_mode": "dual", "identity": "lagrangian", "adaptive_p": 0.0},
        {"jvp_mode": "dual", "teacher": "unused", "identity": "lagrangian"},
        {"jvp_mode": "dual", "teacher": "unused", "one_step_frac": 0.125, "split_above": 0.5, "split_frac": 0.125},
    ],
)
def test_jvp_subset_gives_the_whole_batch_jvps_loss_and_gradients(kwargs):
    """At the same times, the r = t samples' plain forward gives the loss and gradients of the JVP over the batch."""
    n = 8
    torch.manual_seed(0)
    x, y = torch.randn(n, 3, 8, 8), torch.randint(0, 10, (n,))
    proposal = MeanFlow(jvp_subset=True, r_neq_t=0.5, **{k: v for k, v in kwargs.items() if k.endswith("_frac")})
    t, r = proposal.sample_times(n, "cpu")
    m = proposal.jvp_count(n)
    assert 0 < m < n and (r[:m] < t[:m]).all() and (r[m:] == t[m:]).all()
    teacher = tiny_dit(seed=2).requires_grad_(False) if "teacher" in kwargs else None
    results = []
    for subset in (False, True):
        model = tiny_dit(time_inputs=2, seed=1)
        objective = _fixed_times(MeanFlow(jvp_subset=subset, r_neq_t=0.5, label_dropout=0.2, **kwargs), t, r)
        torch.manual_seed(1)
        loss, _ = objective.loss(model, x, y, teacher=teacher)
        loss.backward()
        results.append((loss, [p.grad for p in model.parameters()]))
    (loss_all, grads_all), (loss_subset, grads_subset) = results
    torch.testing.assert_close(loss_subset, loss_all, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads_subset, grads_all, rtol=1e-4, atol=1e-6)


class _Calls(nn.Module):
    """The model, recording each call's batch size and whether its input carries a forward-AD tangent."""

    def __init__(self, model):
        super().__init__()
        self.module, self.calls = model, []  # `module`, as DDP names it: unwrap() finds its classes

    def forward(self, x, t, r=None, y=None):
        self.calls.append((x.shape[0], forward_ad.unpack_dual(x).tangent is not None, torch.is_grad_enabled()))
        return self.module(x, t, r, y)


def test_jvp_subset_takes_the_jvp_on_the_r_neq_t_samples_alone():
    """A batch of 16 at r_neq_t 0.25 and one_step_frac 1/8: the tangent forward and the JVP see the 2 + 4 samples
    with r != t, the other 10 take one plain forward with gradient."""
    model = _Calls(tiny_dit(time_inputs=2, seed=1))
    objective = MeanFlow(jvp_subset=True, r_neq_t=0.25, one_step_frac=0.125, tangent="model")
    torch.manual_seed(0)
    objective.loss(model, torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,)))
    assert model.calls == [(6, False, False), (6, True, True), (10, False, True)]
    t, r = objective.sample_times(16, "cpu")
    assert (r[:6] < t[:6]).all() and (r[6:] == t[6:]).all()
    with pytest.raises(ValueError, match="objective.jvp_subset=false with objective.r_zero"):
        MeanFlow(jvp_subset=True, r_zero=0.1)
    model.calls.clear()  # r_neq_t = 1: no plain forward
    MeanFlow(jvp_subset=True, r_neq_t=1.0).loss(model, torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
    assert model.calls == [(4, True, True)]
    model.calls.clear()  # r_neq_t = 0: flow matching, no JVP
    MeanFlow(jvp_subset=True, r_neq_t=0.0).loss(model, torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
    assert model.calls == [(4, False, True)]


def test_the_consistency_curriculums_alpha_and_step_kinds():
    """alpha is 1 until alpha_steps[0], falls geometrically to alpha_min at alpha_steps[1], where the identity's steps
    begin; a tensor step (a CUDA-graph step's) gives the same alpha; without the curriculum there is one kind of step."""
    objective = MeanFlow(alpha_steps=[100, 300], alpha_min=0.01)
    assert [objective.phase(k) for k in (0, 299, 300, 10**6)] == ["alpha", "alpha", "jvp", "jvp"]
    for step, alpha in [(0, 1.0), (100, 1.0), (200, 0.1), (299, 0.01 ** (199 / 200))]:
        assert objective.alpha(step) == pytest.approx(alpha)
        torch.testing.assert_close(objective.alpha(torch.tensor(step), "alpha"), torch.tensor(alpha))
    assert objective.alpha(300) is None
    assert MeanFlow().phase(5) is None and MeanFlow().alpha(5) is None


def test_the_curriculum_at_alpha_1_is_the_velocity():
    """At alpha = 1 every sample's target is v, whatever r: u = exact + c (t - r) has the error c (t - r), where the
    identity's target charges 2 c (t - r)."""
    torch.manual_seed(0)
    model, x = _GapMeanFlow(A, offset=0.3), _data()
    objective = MeanFlow(r_neq_t=1.0, adaptive_p=0.0, alpha_steps=[10, 20])
    torch.manual_seed(0)
    t, r, err = objective.errors(model, x)
    torch.manual_seed(0)
    _, metrics = objective.loss(model, x, step=0)
    assert metrics["alpha"] == 1.0 and metrics["alpha"].device == x.device  # every metric on the batch's device
    torch.testing.assert_close(metrics["mse"], (0.3 * (t - r)).square().mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(err.square().mean(), (0.6 * (t - r)).square().mean(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("tangent", ["sample", "model"])
def test_the_curriculums_gradient_tends_to_meanflows_as_alpha_falls(tangent):
    """alpha sg(w) ||err / alpha||^2 has MeanFlow's gradient in the limit: its distance to it is O(alpha), < 1e-3 at
    alpha 1e-3 and far more at 0.5; the r = t samples (half of them) take v at every alpha."""
    distance = gradient_distances(lambda **kw: MeanFlow(r_neq_t=0.5, tangent=tangent, **kw), time_inputs=2)
    assert distance[1e-3] < 1e-3 and distance[0.5] > 10 * distance[1e-3], distance


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha_steps": [5, 5]}, "alpha_steps must be"),
        ({"alpha_steps": [10, 2]}, "alpha_steps must be"),
        ({"alpha_steps": [-1, 3]}, "alpha_steps must be"),
        ({"alpha_steps": [0.5, 3]}, "alpha_steps must be"),
        ({"alpha_steps": [3]}, "alpha_steps must be"),
        ({"alpha_steps": 5}, "alpha_steps must be"),
        ({"alpha_steps": "0,10"}, "alpha_steps must be"),
        ({"alpha_steps": [0, 10], "alpha_min": 0.0}, "alpha_min must be in"),
        ({"alpha_steps": [0, 10], "alpha_min": 1.0}, "alpha_min must be in"),
        ({"alpha_steps": [0, 10], "split_above": 0.5}, "does not combine"),
        ({"alpha_steps": [0, 10], "identity": "lagrangian"}, "does not combine"),
    ],
)
def test_the_curriculums_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeanFlow(**kwargs)


@pytest.mark.parametrize("name", ["meanflow_dmd", "meanflow_gan"])
def test_the_regularised_students_refuse_the_curriculum(name):
    from flm.objectives import build_objective

    with pytest.raises(ValueError, match="alpha_steps is not an option of MeanFlow(DMD|GAN)"):
        build_objective(name, teacher="unused", alpha_steps=[0, 10])
