"""Distributed helpers that are correct on one process.

Under `torchrun` they talk to the process group; in a plain `python` process they answer as rank 0
of a world of one, so the training loop never branches on "distributed or not".
"""

import contextlib
import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("flm")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def init(device: str = "auto", timeout_s: float = 600.0) -> torch.device:
    """Join the process group when launched by torchrun or by submitit (hydra/launcher=slurm) with
    more than one process, and pick this rank's device.

    device: "auto" (CUDA when available, else CPU), "cpu" or "cuda". NCCL on CUDA, gloo on the CPU.
    timeout_s: how long a collective waits for a stalled rank before the run ends with an error
    (instead of every other rank waiting silently).
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible here; use trainer.device=auto or cpu")
    if "SUBMITIT_EXECUTOR" in os.environ and "WORLD_SIZE" not in os.environ:
        # a task of a submitit job (hydra/launcher=slurm): torchrun's variables from SLURM's
        import submitit

        submitit.helpers.TorchDistributedEnvironment().export()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local_rank()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            device_id=dev if use_cuda else None,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return dev


def close(synchronize: bool = True) -> None:
    """Tear the process group down, with synchronize after a barrier: a rank that destroys it while a peer's
    last messages are in flight can abort in gloo's teardown (seen once as "terminate called without an active
    exception" in a 2-process CPU test). A rank that failed passes synchronize=False: its peers may never get
    here, and a barrier would wait for them."""
    if not is_initialized():
        return
    if synchronize:
        with contextlib.suppress(RuntimeError):  # a peer that failed and left: nothing to wait for
            dist.barrier()
    dist.destroy_process_group()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def info0(msg: str) -> None:
    """logging.info on rank 0 only (Hydra sends it to the console and the run's train.log)."""
    if is_main():
        log.info(msg)


def all_min(x: torch.Tensor) -> torch.Tensor:
    """Element-wise minimum over ranks (x itself on one process)."""
    if is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return x


def all_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (x itself on one process)."""
    if is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= world_size()
    return x


def all_mean_(tensors: list[torch.Tensor]) -> None:
    """Average `tensors` over ranks in place, in one all-reduce of their concatenation per dtype (nothing on one
    process): one collective for a whole model's gradients, not one per tensor."""
    if not is_initialized():
        return
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.flatten() for t in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world_size()
        torch._foreach_copy_(group, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in group]), group)])


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """The ranks' `x` (the same shape on every rank) concatenated along dim 0 in rank order (x itself on one process)."""
    if not is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    return obj


def check_in_sync(step: int, *modules) -> None:
    """Raise on every rank when the parameters of `modules` differ between ranks (a no-op on one process).

    Data parallelism keeps every replica bit-identical: each rank applies the same all-reduced
    gradients. A per-tensor checksum (float64 sum and sum of squares) that differs between ranks means
    a gradient all-reduce was skipped, which nothing else reports.

    Under FSDP2 only the replicated tensors are compared (the objective's parameters, or any DTensor
    with replicated placements). A sharded parameter has one owner per slice and no second copy to
    compare with; checksums of p.full_tensor() would agree by construction, since it is an all-gather
    of those slices.
    """
    if not is_initialized():
        return
    names, sums = [], []
    named = [(f"{type(m).__name__}.{n}", p) for m in modules if isinstance(m, torch.nn.Module) for n, p in m.named_parameters()]
    for name, p in named:
        if isinstance(p, DTensor):
            if not all(placement.is_replicate() for placement in p.placements):
                continue
            p = p.to_local()
        p = p.detach().double()
        names.append(name)
        sums.append(torch.stack([p.sum(), p.square().sum()]))
    if not sums:
        return
    local = torch.stack(sums)  # (n_tensors, 2)
    lo, hi = all_min(local), local.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    differ = (hi != lo).any(dim=1).nonzero().flatten().tolist()
    if differ:
        shown = ", ".join(names[i] for i in differ[:3]) + (", ..." if len(differ) > 3 else "")
        raise RuntimeError(
            f"parameters differ across ranks after step {step} ({len(differ)} of {len(names)} tensors, e.g. {shown}): "
            f"a gradient all-reduce was skipped. The usual cause is calling the wrapped model's `.module` (for "
            f"example torch.func.jvp or functional_call on model.module), which bypasses DistributedDataParallel's "
            f"gradient hooks; call the DDP-wrapped model itself, as flm.objectives.jvp does. Other causes: a "
            f"parameter changed outside the optimizer on some ranks, or gradients kept under no_sync()."
        )
