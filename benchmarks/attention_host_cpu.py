"""Host time flm's fused attention adds around its kernels, measured on the CPU (issue 16), for host-side changes made
where no GPU is at hand.

The triton_jvp backend's forward and backward kernels are replaced by allocations of their outputs, so what is timed is
flm's Python path of an eager forward + backward (input checks, the autograd.Function, the backward's choice, the
layout rules for cuDNN's feed) on the DiT's (B, H, N, D) views of one qkv projection, beside SDPA's forward + backward
(its small kernels included) and a plain op's (the autograd engine's own cost). Tiny tensors: the rows are host time.
The rows run interleaved in rounds; each cell is the median of the rounds, with their range. A GPU host's figures differ
(benchmarks/attention_host.py measures there); ratios between rows of one run carry over better than the microseconds.

    PYTHONPATH=. python benchmarks/attention_host_cpu.py [--rounds 7] [--calls 500] [--profile]
"""

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton_jvp backend's CPU entry (its kernels are replaced below)

import torch

import flm.attention as fa
from flm.attention import triton_jvp

B, H, N, D = 1, 2, 16, 64


def _outputs_only(q, k, v, tq=None, tk=None, tv=None, **_):
    """attention_fwd's outputs (o, to, lse), allocated and not computed."""
    return torch.empty_like(q), None if tq is None else torch.empty_like(q), q.new_empty(q.shape[:3])


def _stub_kernels() -> str:
    """Replace the fused forward and the backward in use by allocations; the backward's name."""
    triton_jvp.attention_fwd = _outputs_only
    impl = triton_jvp.backward_impl(torch.empty(B, H, N, D))
    triton_jvp.BACKWARDS[impl] = lambda do, q, k, v, *_: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return impl


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=500, help="calls per row and round")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of the fused pair by own time")
    args = p.parse_args()
    torch.set_num_threads(1)
    backward = _stub_kernels()
    qkv = torch.randn(B, N, 3, H, D, requires_grad=True)

    def views():
        return (x.transpose(1, 2) for x in qkv.unbind(2))  # (B, H, N, D) views of (B, N, 3, H, D) storage

    def pair(backend):
        q, k, v = views()
        o = fa.attention(q, k, v, backend=backend)
        return torch.autograd.grad(o, qkv, torch.ones_like(o))

    def plain():
        q, _, _ = views()
        o = q * 1.0
        return torch.autograd.grad(o, qkv, torch.ones_like(o))

    rows = {
        f"fused fwd + bwd, kernels replaced (backward: {backward})": lambda: pair("triton_jvp"),
        "SDPA fwd + bwd (its kernels run)": lambda: pair("sdpa"),
        "a plain op's fwd + bwd on the same views": plain,
    }
    times = {name: [] for name in rows}
    for fn in rows.values():
        for _ in range(50):
            fn()
    for _ in range(args.rounds):
        for name, fn in rows.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)

    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, one thread; (B, H, N, D) = "
        f"({B}, {H}, {N}, {D}); host us per call, median of {args.rounds} interleaved rounds of {args.calls} calls\n"
    )
    print("| row | host us (range) | over the plain op |")
    print("|---|---|---|")
    base = statistics.median(times["a plain op's fwd + bwd on the same views"])
    for name, ts in times.items():
        mid = statistics.median(ts)
        print(f"| {name} | {mid:.1f} ({min(ts):.1f}-{max(ts):.1f}) | {mid - base:+.1f} |")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            pair("triton_jvp")
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
