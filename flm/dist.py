"""Distributed helpers that are correct on one process.

Under `torchrun` they talk to the process group; in a plain `python` process they answer as rank 0
of a world of one, so the training loop never branches on "distributed or not".
"""

import logging
import os

import torch
import torch.distributed as dist

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


def init(device: str = "auto") -> torch.device:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1) and pick this rank's device.

    device: "auto" (CUDA when available, else CPU), "cpu" or "cuda". NCCL on CUDA, gloo on the CPU.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible here; use trainer.device=auto or cpu")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local_rank()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return dev


def close() -> None:
    if is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only."""
    if is_main():
        print(*args, **kwargs, flush=True)


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


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    return obj
