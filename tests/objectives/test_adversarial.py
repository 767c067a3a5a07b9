"""The adversarial loss of a distilled student (flm.objectives.adversarial): which network each term trains,
its gradients against a direct computation, R1, the discriminator's shapes, bad settings.

    python -m pytest tests/objectives/test_adversarial.py -q
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flm.objectives import MeanFlowGAN
from flm.objectives.adversarial import (
    Discriminator,
    FeatureDiscriminator,
    build_discriminator,
    build_feature_discriminator,
)
from tests.models.tiny import tiny_dit


class LinearD(nn.Module):
    """D(x, y) = <w, x> + b_y: its gradient at any x is w, so R1 = ||w||^2."""

    def __init__(self, shape, classes=10):
        super().__init__()
        self.w = nn.Parameter(torch.randn(shape) * 0.1)
        self.b = nn.Parameter(torch.randn(classes) * 0.1)

    def forward(self, x, y=None):
        return (x * self.w).flatten(1).sum(1) + (0 if y is None else self.b[y])


def _setup(**kwargs):
    objective = MeanFlowGAN(teacher="unused", r_neq_t=1.0, label_dropout=0.0, **kwargs)
    student, teacher = tiny_dit(time_inputs=2, seed=1), tiny_dit(seed=2).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.tensor([0, 3, 7, 9, 1, 2, 4, 5])
    return objective, student, teacher, x, y


def _grads(loss, params):
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))]


def test_each_term_trains_its_own_network_and_the_students_gradient_is_through_d():
    objective, student, teacher, x, y = _setup(adv_weight=0.5, adv_frac=0.5, r1_gamma=1.0)
    d = LinearD((3, 8, 8))
    torch.manual_seed(1)
    losses, metrics = objective.loss(student, x, y, teacher=teacher, discriminator=d)
    assert set(losses) == {"model", "discriminator"}
    s_params, d_params = list(student.parameters()), list(d.parameters())
    assert all(g.abs().max() == 0 for g in _grads(losses["model"], d_params)), "the student's term trained D"
    assert all(g.abs().max() == 0 for g in _grads(losses["discriminator"], s_params)), "D's term trained the student"

    # the same draws without the adversarial term, and the direct generator loss with D frozen
    torch.manual_seed(1)
    plain, _ = MeanFlowGAN(teacher="unused", r_neq_t=1.0, label_dropout=0.0, adv_weight=0.0).loss(
        student, x, y, teacher=teacher, discriminator=d
    )
    torch.manual_seed(1)
    objective.errors(student, x, y, teacher=teacher)  # the MeanFlow loss's draws, then generate's noise
    x_g = objective.generate(student, x[:4], y[:4])
    d.requires_grad_(False)
    direct = plain["model"] + 0.5 * F.softplus(-d(x_g, y[:4])).mean()
    torch.testing.assert_close(losses["model"], direct, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(_grads(losses["model"], s_params), _grads(direct, s_params)):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
    assert metrics["adv"] > 0 and "r1" in metrics


def test_discriminator_loss_and_r1_against_a_linear_d():
    objective, student, teacher, x, y = _setup(adv_frac=0.25, r1_gamma=2.0)
    d = LinearD((3, 8, 8))
    torch.manual_seed(1)
    losses, metrics = objective.loss(student, x, y, teacher=teacher, discriminator=d)
    torch.manual_seed(1)
    objective.errors(student, x, y, teacher=teacher)
    with torch.no_grad():
        x_g = objective.generate(student, x[:2], y[:2])
        expected = F.softplus(-d(x, y)).mean() + F.softplus(d(x_g, y[:2])).mean() + 0.5 * 2.0 * d.w.square().sum()
    torch.testing.assert_close(losses["discriminator"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["r1"], d.w.detach().square().sum(), rtol=1e-5, atol=0)


@pytest.mark.parametrize(("size", "channels", "classes"), [(28, 1, 10), (32, 4, 0), (8, 3, 1000)])
def test_discriminator_shapes(size, channels, classes):
    d = build_discriminator({"in_channels": channels, "num_classes": classes, "input_size": size}, width=8, depth=3)
    y = torch.tensor([0, classes - 1]) if classes else None
    out = d(torch.randn(2, channels, size, size), y)
    assert out.shape == (2,) and torch.isfinite(out).all()
    assert isinstance(d, Discriminator) and (d.embed is None) == (classes == 0)


def test_dit_features_are_the_hidden_states_after_the_chosen_blocks():
    model = tiny_dit(seed=3)
    seen = []
    hooks = [block.register_forward_hook(lambda m, i, o: seen.append(o)) for block in model.blocks]
    x, t, y = torch.randn(2, 3, 8, 8), torch.rand(2), torch.tensor([1, 10])
    model(x, t, None, y)
    for h in hooks:
        h.remove()
    features = model(x, t, None, y, features=(1, 0))
    torch.testing.assert_close(features[0], seen[1], rtol=0, atol=0)
    torch.testing.assert_close(features[1], seen[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"indices in \[0, 2\)"):
        model(x, t, None, y, features=(2,))


def _teacher_backbone(**kwargs):
    objective, student, teacher, x, y = _setup(disc_backbone="teacher", r1_gamma=0.0, **kwargs)
    args = {"name": "DiT-T/2", "num_classes": 10}
    d = build_feature_discriminator(args, width=8, blocks=None)
    with torch.no_grad():  # nonzero class projections
        for p in d.parameters():
            p.normal_(std=0.3)
    return objective, student, teacher, x, y, d


def test_the_teacher_backbone_trains_the_heads_and_the_student_through_the_frozen_teacher():
    objective, student, teacher, x, y, d = _teacher_backbone(adv_weight=0.5, adv_frac=0.5)
    assert d.feature_blocks == (0, 1)  # a DiT of depth 2: its four evenly spaced blocks collapse to both
    torch.manual_seed(1)
    losses, metrics = objective.loss(student, x, y, teacher=teacher, discriminator=d)
    s_params, d_params = list(student.parameters()), list(d.parameters())
    assert all(g.abs().max() == 0 for g in _grads(losses["model"], d_params)), "the student's term trained D"
    assert all(g.abs().max() == 0 for g in _grads(losses["discriminator"], s_params)), "D's term trained the student"
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())

    # the direct computation with the same draws: the MeanFlow loss, then generate's noise, then the noise levels
    # and noises of the generated and the data images, in that order
    torch.manual_seed(1)
    base, _ = MeanFlowGAN(
        teacher="unused", r_neq_t=1.0, label_dropout=0.0, adv_weight=0.0, disc_backbone="teacher", r1_gamma=0.0
    ).loss(student, x, y, teacher=teacher, discriminator=d)
    torch.manual_seed(1)
    objective.errors(student, x, y, teacher=teacher)
    x_g = objective.generate(student, x[:4], y[:4])
    d.requires_grad_(False)
    fake = d(objective.seen(x_g, y[:4], teacher, d), y[:4])
    real = d(objective.seen(x[:4], y[:4], teacher, d), y[:4])
    direct = base["model"] + 0.5 * F.softplus(-fake).mean()
    torch.testing.assert_close(losses["model"], direct, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(_grads(losses["model"], s_params), _grads(direct, s_params)):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
    expected = F.softplus(-real).mean() + F.softplus(fake).mean()
    torch.testing.assert_close(losses["discriminator"], expected.detach(), rtol=1e-5, atol=1e-6)
    assert fake.shape == (4, 2) and "r1" not in metrics


@pytest.mark.parametrize(("blocks", "expected"), [(None, (2, 5, 8, 11)), ([3], (3,)), ([11, 0], (11, 0))])
def test_feature_discriminator_blocks(blocks, expected):
    d = build_feature_discriminator({"name": "DiT-S/2", "num_classes": 0}, width=4, blocks=blocks)
    assert isinstance(d, FeatureDiscriminator) and d.feature_blocks == expected
    out = d([torch.randn(2, 5, 384) for _ in expected])
    assert out.shape == (2, len(expected)) and torch.isfinite(out).all()


@pytest.mark.parametrize("blocks", [[12], [], [-1], [1.5]])
def test_feature_blocks_outside_the_teacher_are_refused(blocks):
    with pytest.raises(ValueError, match=r"objective.disc_blocks must be block indices in \[0, 12\)"):
        build_feature_discriminator({"name": "DiT-S/2", "num_classes": 10}, width=4, blocks=blocks)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"disc_backbone": "vgg"}, "disc_backbone must be one of cnn, teacher"),
        ({"disc_backbone": "teacher"}, "set objective.r1_gamma=0 with objective.disc_backbone=teacher"),
        ({"disc_t_std": 0.0}, "disc_t_std > 0"),
        ({"adv_weight": -1.0}, "adv_weight >= 0"),
        ({"adv_frac": 0.0}, r"adv_frac in \(0, 1\]"),
        ({"disc_lr": 0.0}, "disc_lr > 0"),
        ({"r1_gamma": -0.1}, "r1_gamma >= 0"),
        ({"disc_width": 0}, "disc_width must be an int >= 1"),
        ({"disc_depth": 2.5}, "disc_depth must be an int >= 1"),
        ({"teacher": ""}, "objective.teacher is not set"),
        ({"adv_loss": "hinge"}, "adv_loss must be one of gan, feature_matching"),
        ({"adv_loss": "feature_matching"}, "matches the teacher's features; set objective.disc_backbone=teacher"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeanFlowGAN(**({"teacher": "unused"} | kwargs))


def test_r1_under_several_processes_is_refused(monkeypatch):
    objective, student, teacher, x, y = _setup(r1_gamma=0.1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match="set objective.r1_gamma=0 for a multi-process run"):
        objective.loss(student, x, y, teacher=teacher, discriminator=LinearD((3, 8, 8)))
    objective.r1_gamma = 0.0
    losses, _ = objective.loss(student, x, y, teacher=teacher, discriminator=LinearD((3, 8, 8)))
    assert torch.isfinite(losses["discriminator"])


def test_feature_matching_is_zero_for_the_data_itself_and_pulls_a_shifted_batch_back():
    """adv_loss=feature_matching: no discriminator network; the term vanishes when the generated images are the data
    images (same s, same noise draws), and its gradient moves a shifted batch towards the data."""
    from flm.models import build_model
    from flm.objectives.meanflow import MeanFlowGAN

    objective = MeanFlowGAN(teacher="unused", disc_backbone="teacher", r1_gamma=0.0, adv_loss="feature_matching")
    assert "discriminator" not in objective.networks
    torch.manual_seed(0)
    teacher = build_model("DiT-T/4", input_size=8, in_channels=1, num_classes=10).requires_grad_(False)
    x, y = torch.randn(6, 1, 8, 8), torch.arange(6)
    torch.manual_seed(1)
    same = objective.feature_matching(x.clone(), x, y, teacher)
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    shifted = (x + 0.5).requires_grad_(True)
    loss = objective.feature_matching(shifted, x, y, teacher)
    (grad,) = torch.autograd.grad(loss, shifted)
    assert loss.item() > 0.01 and (grad.mean() > 0)  # descending it lowers the shift
