"""flm.train.parallel and the checkpoint state helpers in one process: FSDP2 on a gloo group of one
rank (the same hooks and DTensors as with many) against the unsharded model."""

import copy

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor

from flm.models import build_model
from flm.objectives import build_objective
from flm.objectives.jvp import jvp
from flm.train import checkpoint, parallel
from flm.train.optim import OptimConfig, build_optimizer, optimizer_step


@pytest.fixture
def group_of_one():
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def tiny_dit(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model("DiT-T/4", input_size=8, in_channels=1, num_classes=3, time_inputs=2, attention="math")
    with torch.no_grad():  # move the zero-initialised layers off zero so that every gradient is non-trivial
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def sharded(model: nn.Module) -> nn.Module:
    return parallel._fully_shard(copy.deepcopy(model), torch.device("cpu"))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("mode", ["dual", "two_pass"])
def test_jvp_through_fsdp2_matches_the_unsharded_model(group_of_one, mode):
    """The forward-AD rule flm gives FSDP2's RegisterPostBackwardFunction: same output, tangent and
    gradients as without FSDP2. Fails if torch moves or changes that internal."""
    model = tiny_dit()
    fsdp_model = sharded(model)
    assert all(isinstance(p, DTensor) for p in fsdp_model.parameters())
    x, t, r, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.rand(3) * 0.5, torch.tensor([0, 1, 2])
    v = torch.randn_like(x)
    results = []
    for m in (model, fsdp_model):
        out, tangent = jvp(lambda z, t_: m(z, t_, r, y), (x, t), (v, torch.ones_like(t)), mode=mode)
        (out * tangent).sum().backward()  # a loss of the output with the (detached) tangent in it
        results.append((out.detach(), tangent, {n: full(p.grad) for n, p in m.named_parameters()}))
    (out, tangent, grads), (out_s, tangent_s, grads_s) = results
    torch.testing.assert_close(out_s, out)
    torch.testing.assert_close(tangent_s, tangent)
    torch.testing.assert_close(grads_s, grads)
    assert tangent.abs().sum() > 0 and all(g.abs().sum() > 0 for g in grads.values())


def test_clip_grad_norm_over_sharded_and_plain_gradients(group_of_one):
    model = tiny_dit()
    fsdp_model = sharded(model)
    x, t, w = torch.randn(2, 1, 8, 8), torch.rand(2), torch.randn(5)
    totals, extras = [], []
    for m, clip in ((model, nn.utils.clip_grad_norm_), (fsdp_model, parallel.clip_grad_norm_)):
        extra = nn.Parameter(w.clone())  # an objective's parameter: not sharded
        (m(x, t, t).square().sum() + extra.square().sum()).backward()
        totals.append(clip(list(m.parameters()) + [extra], 0.5))
        extras.append(extra.grad)
    assert not isinstance(totals[1], DTensor)
    torch.testing.assert_close(totals[1], totals[0])
    torch.testing.assert_close(extras[1], extras[0])
    for p, q in zip(model.parameters(), fsdp_model.parameters()):
        torch.testing.assert_close(full(q.grad), p.grad)


def optimizer_after_a_step(model: nn.Module, objective: nn.Module):
    opt, sched = build_optimizer(list(model.parameters()) + list(objective.parameters()), OptimConfig(lr=1e-2))
    x, t = torch.randn(2, 1, 8, 8), torch.rand(2)
    (model(x, t, t).square().mean() + sum(p.square().sum() for p in objective.parameters())).backward()
    optimizer_step(opt, sched, skip=torch.zeros(()))
    return opt


def test_optimizer_state_keeps_torch_optim_layout_and_round_trips(group_of_one):
    objective = build_objective("scm")  # it has parameters of its own, outside the model
    model = tiny_dit()
    opt = optimizer_after_a_step(model, objective)
    trained = nn.ModuleDict({"model": model, "objective": objective})
    saved = checkpoint.optimizer_state(trained, opt)
    torch.testing.assert_close(saved, opt.state_dict())  # the format of today's checkpoints

    fsdp_model = sharded(tiny_dit(seed=1))
    fsdp_opt = optimizer_after_a_step(fsdp_model, objective)
    fsdp_trained = nn.ModuleDict({"model": fsdp_model, "objective": objective})
    checkpoint.load_optimizer_state(fsdp_trained, fsdp_opt, copy.deepcopy(saved))
    assert isinstance(fsdp_opt.state[next(fsdp_model.parameters())]["exp_avg"], DTensor)
    torch.testing.assert_close(checkpoint.optimizer_state(fsdp_trained, fsdp_opt), saved)
    checkpoint.load_model_state(fsdp_model, checkpoint.model_state(model))
    torch.testing.assert_close(checkpoint.model_state(fsdp_model), model.state_dict())
