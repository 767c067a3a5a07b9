"""A skipped (non-finite) step decided on the device: the optimizer and the EMA leave everything as it
was, with no host sync (the gpu test checks that with torch's sync debug mode)."""

import math

import pytest
import torch
from torch import nn

from flm.objectives import build_objective
from flm.train.ema import EMA
from flm.train.optim import OptimConfig, build_optimizer, load_schedule, optimizer_step, warmup_factor
from flm.train.parallel import clip_grad_norm_
from tests.models.tiny import tiny_dit


def _model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).to(device)


def _backward(model, scale=1.0):
    model(torch.randn(3, 4, device=next(model.parameters()).device)).sum().mul(scale).backward()


def test_a_skipped_step_leaves_weights_moments_and_count():
    model = _model()
    opt, sched = build_optimizer(list(model.parameters()), OptimConfig(lr=1e-2, warmup_steps=4))
    _backward(model)
    optimizer_step(opt, sched, skip=torch.zeros(()))
    opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}

    _backward(model, scale=float("nan"))
    optimizer_step(opt, sched, skip=torch.ones(()))
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p, w)
    for k, v in opt.state[model[0].weight].items():
        assert torch.equal(v, state[k]), k  # step stays 1: Adam's bias correction ignores the skip
    assert sched.last_epoch == 2  # the schedule counts every step
    opt.zero_grad()

    _backward(model)
    optimizer_step(opt, sched, skip=torch.zeros(()))
    assert opt.state[model[0].weight]["step"].item() == 2
    assert not torch.equal(model[0].weight, weights[0])


def test_ema_update_with_apply_zero_keeps_the_averages_and_one_matches_the_plain_update():
    model = _model()
    ema, plain = EMA(model, [0.9, 0.99]), EMA(model, [0.9, 0.99])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = [p.clone() for p in ema.default.parameters()]
    ema.update(model, step=100, apply=torch.zeros(()))
    for p, b in zip(ema.default.parameters(), before):
        assert torch.equal(p, b)
    ema.update(model, step=100, apply=torch.ones(()))
    plain.update(model, step=100)
    for key in ema.models:
        for p, q in zip(ema.models[key].parameters(), plain.models[key].parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
        assert not torch.equal(next(ema.models[key].parameters()), before[0])


@pytest.mark.gpu
@pytest.mark.parametrize("objective_name", ["flow_matching", "meanflow", "scm"])
def test_a_training_step_issues_no_host_sync(objective_name):
    """loss, backward, clipping, the finiteness flag, the optimizer and the EMA: what the loop runs between
    two steps that neither log nor save, under torch's sync debug mode (it raises on .item(), nonzero, ...)."""
    objective = build_objective(objective_name).cuda()
    model = tiny_dit(attention="triton_jvp", time_inputs=objective.time_inputs, input_size=16, channels=4).cuda()
    params = list(model.parameters()) + list(objective.parameters())
    opt, sched = build_optimizer(params, OptimConfig(lr=1e-4))
    ema = EMA(model, [0.999])
    x, y = torch.randn(8, 4, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda")

    def step(at):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = objective.loss(model, x, y, step=at)
        loss.backward()
        norm = clip_grad_norm_(params, 1.0)
        finite = (torch.isfinite(loss.detach()) & torch.isfinite(norm)).float()
        optimizer_step(opt, sched, skip=1.0 - finite)
        ema.update(model, at, apply=finite)
        opt.zero_grad(set_to_none=True)

    step(0)  # first calls: tuning, lazy state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for at in (1, 2):
            step(at)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_resumed_schedule_uses_the_new_settings():
    old = OptimConfig(lr=1e-3, warmup_steps=10, weight_decay=0.1)
    model = _model()
    opt, sched = build_optimizer(list(model.parameters()), old)
    for _ in range(3):
        _backward(model)
        optimizer_step(opt, sched, skip=torch.zeros(()))
    new = OptimConfig(lr=1e-5, warmup_steps=10, weight_decay=0.0)
    opt2, sched2 = build_optimizer(list(model.parameters()), new)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 * 4 / 10)  # the checkpoint's, until load_schedule
    load_schedule(opt2, sched2, sched.state_dict(), new)
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-5 * 4 / 10) == sched2.get_last_lr()[0]
    assert opt2.param_groups[0]["weight_decay"] == 0.0 and sched2.last_epoch == 3
    _backward(model)
    optimizer_step(opt2, sched2, skip=torch.zeros(()))
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-5 * 5 / 10)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_the_learning_rate_warms_up_then_decays_to_min_lr_ratio(decay):
    cfg = OptimConfig(lr=1.0, warmup_steps=10, decay=decay, decay_steps=110, min_lr_ratio=0.1)
    factor = [warmup_factor(cfg, step) for step in range(130)]
    assert factor[0] == pytest.approx(0.1) and factor[9] == factor[10] == pytest.approx(1.0)  # the warm-up, then full lr
    half = 0.1 + 0.9 * 0.5  # halfway through the decay: cos(pi / 2) = 0 and the linear midpoint agree
    assert factor[60] == pytest.approx(half)
    quarter = 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi / 4)) if decay == "cosine" else 0.75)
    assert factor[35] == pytest.approx(quarter)
    assert factor[110] == factor[129] == pytest.approx(0.1)  # held at min_lr_ratio after decay_steps
    assert all(a >= b for a, b in zip(factor[10:], factor[11:]))
    assert [warmup_factor(OptimConfig(lr=1.0, warmup_steps=10), s) for s in (9, 500)] == [1.0, 1.0]  # decay=none


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decay": "step"}, "optim.decay must be one of none, cosine, linear"),
        ({"decay": "cosine", "decay_steps": 10, "warmup_steps": 10}, r"\(default: trainer.max_steps\) > optim.warmup"),
        ({"min_lr_ratio": 1.5}, r"optim.min_lr_ratio must be in \[0, 1\]"),
    ],
)
def test_bad_decay_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)


def test_decay_steps_default_to_the_runs_max_steps():
    from flm.train.optim import with_decay_steps

    cfg = OptimConfig(lr=1.0, decay="linear")
    assert cfg.decay_steps is None and with_decay_steps(cfg, 100).decay_steps == 100
    assert with_decay_steps(OptimConfig(lr=1.0, decay="linear", decay_steps=50), 100).decay_steps == 50
    with pytest.raises(ValueError, match=r"> optim.warmup_steps \(200\), got 100; raise it or lower optim.warmup_steps"):
        with_decay_steps(OptimConfig(lr=1.0, decay="cosine", warmup_steps=200), 100)
