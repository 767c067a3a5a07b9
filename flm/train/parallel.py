"""Data parallelism for the training loop (`trainer.parallel`): DDP or FSDP2 under torchrun, the model
itself on one process.

- ddp: every rank holds the whole model; backward all-reduces the gradients (under trainer.cuda_graph=true
  the optimizer does, after the graph: wrap()).
- fsdp: FSDP2 (`fully_shard`) on each DiT block, then on the root, over a 1-D mesh of all ranks (the
  torchtitan recipe): a rank keeps 1/N of the parameters, gradients and optimizer state and
  all-gathers a block's weights just before it runs. Mixed precision stays bf16 autocast (parameters,
  all-gathers and reduce-scatters in fp32), so both modes compute the same step.

Either way N ranks train as one with the same global batch (tests/train/test_distributed.py), and
checkpoints hold whole tensors (flm.train.checkpoint), whatever the mode that wrote them.
"""

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flm import dist

PARALLEL = ("ddp", "fsdp")


def wrapper_syncs(parallel: str, *, cuda_graph: bool) -> bool:
    """Whether wrap() gives a model that averages its gradients over the ranks itself (DDP's hooks, FSDP2's
    reduce-scatters). Where it does not, the optimizer averages them (flm.train.optim.Optimizer's `replicated`)."""
    return dist.world_size() > 1 and not (parallel == "ddp" and cuda_graph)


def wrap(model: nn.Module, device: torch.device, parallel: str, *, cuda_graph: bool = False) -> nn.Module:
    """The model to train: DDP or FSDP2 under torchrun, the model itself on one process.

    With trainer.cuda_graph=true DDP is left out: its reducer all-reduces gradient buckets from autograd hooks
    that decide on the host, at every backward, what is ready (and skip it under no_sync), and a graph replay
    runs no hooks. PyTorch can capture DDP (static_graph=True, eager warm-up iterations), but with gradient
    accumulation that takes one graph with the all-reduce and one without, around the reducer's internals.
    Instead the graph captures loss + backward of the plain model, and after the step's last replay the
    optimizer averages all gradients in one flat all-reduce (flm.dist.all_mean_), outside the graph: the same
    mean gradient as DDP's, with the communication after the backward rather than overlapped with it.
    """
    if not wrapper_syncs(parallel, cuda_graph=cuda_graph):
        return model
    if parallel == "fsdp":
        return _fully_shard(model, device)
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def wrap_copy(model: nn.Module, device: torch.device, parallel: str) -> nn.Module:
    """A copy that is not trained (an EMA), placed like the trained model: sharded the same way under
    FSDP2, so averaging is shard by shard with no communication (and sampling from it takes every
    rank); whole otherwise. Call it on copies taken before wrap(), which shards the model in place."""
    if not sharded(parallel):
        return model
    return _fully_shard(model, device)


def sharded(parallel: str) -> bool:
    """Whether wrap() and wrap_copy() shard a network's parameters (FSDP2 under torchrun), rather than keep them whole."""
    return dist.world_size() > 1 and parallel == "fsdp"


def _fully_shard(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _install_forward_ad_rule()
    mesh = init_device_mesh(device.type, (dist.world_size(),))
    for block in getattr(model, "blocks", ()):  # DiT's blocks: one all-gather each, overlapped with compute
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the rest (embedders, final layer)
    return model


def _identity_jvp(ctx, param_group_tangent, *tangents):
    # forward returns its inputs as they are; autograd then wants each output's tangent to be a view
    # of the input's tangent (returning the tangent itself fails its aliasing check)
    return tuple(None if t is None else t.view_as(t) for t in tangents)


def _install_forward_ad_rule() -> None:
    """Let forward-AD dual tensors (objective.jvp_mode=dual) through FSDP2's hooks.

    Before a sharded module runs, FSDP2 passes its tensor arguments through RegisterPostBackwardFunction,
    an identity autograd.Function whose backward starts the module's gradient reduce-scatter. torch
    gives it no usable forward-mode rule (2.11: none; 2.14: one that returns the tangents themselves,
    which autograd rejects), so a dual pass through a sharded block raises. The Function is the
    identity, so the right JVP is the identity: tangents pass through, and the reverse-mode graph, hence
    the reduce-scatter, is as torch built it. Installed on the class (idempotent) when FSDP2 is chosen;
    tests/train/test_parallel.py compares tangents and gradients with an unsharded model, so it fails if
    torch changes this internal. jvp_mode=two_pass needs no rule: its dual pass runs under no_grad,
    where FSDP2 applies no Function.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction
    except ImportError:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed.fsdp._fully_shard._fsdp_param_group."
            f"RegisterPostBackwardFunction, which flm gives the forward-AD rule that JVP objectives need under "
            f"FSDP2; use trainer.parallel=ddp, or update flm.train.parallel for this torch"
        ) from None
    RegisterPostBackwardFunction.jvp = staticmethod(_identity_jvp)


def grad_sync(model: nn.Module, enabled: bool):
    """Context in which backward all-reduces gradients only if `enabled` (DDP's no_sync for gradient
    accumulation). FSDP2 reduce-scatters every micro-batch: its gradients stay sharded, the memory it is
    chosen for."""
    if enabled or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter or gradient (the tensor itself if not sharded); under
    no_grad it shares storage, so in-place updates of it update the parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """nn.utils.clip_grad_norm_, also over FSDP2's sharded gradients next to plain ones (the objective's
    parameters are not sharded, and torch refuses the mix). Returns the total norm as a plain tensor, the
    same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return nn.utils.clip_grad_norm_(params, max_norm)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norm_sharded = nn.utils.get_total_norm(sharded).full_tensor()  # reduced over ranks already
    total = torch.linalg.vector_norm(torch.stack([norm_sharded, nn.utils.get_total_norm(plain).to(norm_sharded)]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as nn.utils.clip_grads_with_norm_
    torch._foreach_mul_([local(g) for g in grads], coef)
    return total
