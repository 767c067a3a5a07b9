"""Which aten ops of one eager training step would launch GPU kernels, counted on the CPU, by op and by source line.

On a GPU a graphed step's time is its kernels', and at MNIST sizes most of them are small copies, casts and
elementwise ops (docs/train_step.md, Run O). This counts them without a GPU: one eager step of `benchmarks/
train_step.py`'s (bf16 autocast, DiT at a few tokens), with what differs on a GPU made as it is there: the fused adaLN
kernels run in Triton's CPU interpreter (their launches are not aten ops; the interpreter's own copies are left out)
and a teacher is frozen with its linear weights in bf16 (flm.train.loop.frozen). Views, metadata and host-only ops
are left out, and so is the optimizer (one fused kernel on a GPU). The attention backward differs: cuDNN's on a
Hopper GPU, flm's Triton one here.

    PYTHONPATH=. python benchmarks/kernel_census.py --objective scd --backend triton_jvp
"""

import argparse
import collections
import os
import sys
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before flm's kernels are imported: the adaLN kernels run on the CPU

from torch.utils._python_dispatch import TorchDispatchMode

import benchmarks.train_step as train_step
from flm.kernels import adaln
from flm.kernels.attention_fwd import interpreted
from flm.models import MODEL_SIZES
from flm.train.loop import frozen

# ops that launch no kernel (views, metadata, allocation, forward-AD bookkeeping, host reads)
HOST_OPS = {
    *("view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "alias", "detach", "view_as", "t"),
    *("transpose", "permute", "unsqueeze", "unsqueeze_", "squeeze", "expand", "slice", "select", "split"),
    *("split_with_sizes", "unbind", "chunk", "empty", "empty_like", "empty_strided", "new_empty", "set_", "resize_"),
    *("lift_fresh", "is_same_size", "_has_same_storage_numel", "_local_scalar_dense", "_efficientzerotensor"),
    *("_make_dual", "_unpack_dual", "_fw_primal", "_conj", "resolve_conj", "resolve_neg", "item", "is_nonzero"),
}
SKIPPED_FRAMES = ("triton/runtime/interpreter", "torch/optim")  # the interpreter's copies; the optimizer


class Census(TorchDispatchMode):
    """Counts each kernel-launching aten op by name and by the innermost flm or benchmark line that called it."""

    def __init__(self):
        super().__init__()
        self.ops, self.lines = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in HOST_OPS:
            stack = traceback.extract_stack()
            if not any(skip in frame.filename for frame in stack for skip in SKIPPED_FRAMES):
                ours = [f for f in stack[:-1] if "/flm/" in f.filename or "/benchmarks/" in f.filename]
                where = f"{ours[-1].filename.rpartition('/')[2]}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"
                self.ops[name] += 1
                self.lines[(name, where)] += 1
        return func(*args, **(kwargs or {}))


def census(objective: str, backend: str, mode: str, model: str, tokens: int, casts: str = "bulk") -> Census:
    args = train_step.parse_args(
        ["--models", model, "--tokens", str(tokens), "--batch-tokens", str(2 * tokens), "--channels", "1"]
        + ["--num-classes", "10", "--objectives", objective, "--backends", backend, "--modes", mode, "--bf16"]
        + ["--iters", "1", "--warmup", "1", "--casts", casts]
    )

    def frozen_as_on_a_gpu(net, network, device, parallel):  # the loop's rule, as it decides for a GPU
        return frozen(net, network, torch.device("cuda"), parallel)

    saved = adaln.FORCE, train_step.frozen
    adaln.FORCE, train_step.frozen = True, frozen_as_on_a_gpu
    try:
        cpu = torch.device("cpu")
        step, _ = train_step.build_step(model, tokens, objective, backend, mode, "eager", args, cpu, torch.bfloat16)
        with Census() as counted:
            step(0)
    finally:
        adaln.FORCE, train_step.frozen = saved
    return counted


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--objective", default="scd", help="a benchmarks/train_step.py objective (default scd)")
    p.add_argument("--backend", default="triton_jvp", help="attention backend (default triton_jvp)")
    p.add_argument("--mode", default="dual", help="jvp_mode (default dual)")
    p.add_argument("--model", default="DiT-S/2", choices=list(MODEL_SIZES), metavar="MODEL", help="a DiT size (default DiT-S/2)")
    p.add_argument("--tokens", type=int, default=16, help="a square number (default 16: the counts do not depend on it)")
    p.add_argument("--lines", type=int, default=30, help="source lines to list (default 30)")
    p.add_argument("--casts", choices=["each", "bulk"], default="bulk", help="the parameters' casts (train_step.py's --casts)")
    args = p.parse_args(argv)
    if not interpreted():
        raise SystemExit("error: the census runs flm's Triton kernels on the CPU: run it with TRITON_INTERPRET=1")
    try:
        counted = census(args.objective, args.backend, args.mode, args.model, args.tokens, args.casts)
    except ValueError as err:  # an unknown objective, backend, mode or model, or a token count that is not a square
        raise SystemExit(f"error: {err}") from None
    print(
        f"{args.model}, {args.tokens} tokens, {args.objective} ({args.backend}, {args.mode}, casts {args.casts}), torch {torch.__version__}"
    )
    print(f"\nkernel-launching aten ops in one step: {sum(counted.ops.values())}\n\n| op | count |\n|---|---|")
    for name, n in counted.ops.most_common():
        print(f"| {name} | {n} |")
    print("\n| op | called from | count |\n|---|---|---|")
    for (name, where), n in counted.lines.most_common(args.lines):
        print(f"| {name} | {where} | {n} |")


if __name__ == "__main__":
    sys.exit(main())
