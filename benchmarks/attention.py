"""Attention JVP benchmark: fused Triton JVP forward vs FA2 / cuDNN forward vs math-attention JVP.

    PYTHONPATH=. python benchmarks/attention.py                      # full table (one H200: ~5 min)
    PYTHONPATH=. python benchmarks/attention.py --head-dims 64 --tokens 1024 4096 --out results/
    PYTHONPATH=. python benchmarks/attention.py --backwards cudnn triton   # the backward alone, per implementation

bf16, batch x heads = 64 (heads = 16; --batch-heads and --heads change them: a DiT-S/2 MNIST step at batch 256 runs
256 x 6 = 1536 at 196 tokens). Kernel times are medians of CUDA-graph replays (GPU time; the
fused path's host overhead per call is its own column); math JVP is timed eagerly (GPU-bound). FLOPs of a forward: 4 * B * H * Lq * Lkv * D; the JVP forward is
counted as 3 forwards (six matmuls instead of two). Peak memory is what the call allocates on top of
its inputs (outputs included). "first call" is the wall time of the first call at a new shape,
autotuning and compilation included; tuned configs are cached on disk by Triton for later runs.
A bf16 matmul (8192^3) measured in the same run gives the ceiling.

--backwards NAME... times only the fused attention's backward (flm.attention.triton_jvp.BACKWARDS), fed
with flm's forward O and lse, non-causal and causal: median ms of CUDA-graph replays per implementation,
torch_fa2 always among them, and each one's speed-up over torch_fa2 (its ms / the implementation's ms) in
the same run; "first call" is the wall time of the first call at the shape (cuDNN builds its plan there).
"""

import argparse
import json
import os
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flm.attention as fa
from flm.attention import math as math_backend
from flm.attention import triton_jvp
from flm.kernels import attention_fwd


def gpu_ms(fn) -> float:
    """Median GPU time of fn, replayed from a CUDA graph so host overhead does not count."""
    fn()  # tune and compile outside the capture
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def host_us(fn, calls: int = 20, rounds: int = 9) -> float:
    """Host (Python + launch) time per call: the median over `rounds` of `calls` calls issued without waiting for the
    GPU. Rounds are short and synchronised so that the launch queue never fills: once it does, a launch waits for the
    GPU and GPU time reads as host time."""
    fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[rounds // 2]


def peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def matmul_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / gpu_ms(lambda: a @ b) / 1e9


def run_row(d: int, n: int, heads: int = 16, bh: int = 64, dtype=torch.bfloat16) -> dict:
    b = bh // heads
    q, k, v, tq, tk, tv = (torch.randn(b, heads, n, d, device="cuda", dtype=dtype) for _ in range(6))
    flops = 4 * b * heads * n * n * d
    row = {"head_dim": d, "tokens": n, "batch": b, "heads": heads}

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fa.jvp_attention(q, k, v, tq, tk, tv)
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - t0
    row["fwd_config"] = attention_fwd.last_choice()  # the first call tuned this shape
    row["jvp_ms"] = gpu_ms(lambda: fa.jvp_attention(q, k, v, tq, tk, tv))
    row["jvp_host_us"] = host_us(lambda: fa.jvp_attention(q, k, v, tq, tk, tv))
    row["jvp_tflops"] = 3 * flops / row["jvp_ms"] / 1e9
    row["jvp_mib"] = peak_extra_mib(lambda: fa.jvp_attention(q, k, v, tq, tk, tv))

    row.update(train_ms(q, k, v, tq, tk, tv, row["jvp_ms"]))

    for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ms = gpu_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
            row[f"{name}_tflops"] = flops / ms / 1e9
        except RuntimeError as e:
            row[f"{name}_tflops"] = None
            row[f"{name}_error"] = str(e).splitlines()[0][:80]

    scale = d**-0.5
    math_jvp = lambda: torch.func.jvp(  # noqa: E731
        lambda a, b_, c: math_backend.attention(a, b_, c, causal=False, scale=scale), (q, k, v), (tq, tk, tv)
    )
    try:
        row["math_mib"] = peak_extra_mib(math_jvp)
        row["math_ms"] = triton.testing.do_bench(math_jvp, rep=100, return_mode="median")  # GPU-bound
    except torch.OutOfMemoryError:
        row["math_ms"] = row["math_mib"] = None
    torch.cuda.empty_cache()
    return row


def train_ms(q, k, v, tq, tk, tv, jvp_fwd: float) -> dict:
    """What a training step pays for attention: the fused JVP forward plus the backward of o (the tangent takes no
    gradient), against SDPA's forward plus backward (PyTorch's choice of kernel; cuDNN on Hopper), in GPU ms, and the
    host time of each (what an eager step pays before the GPU can start). The backward columns are the differences to
    each one's forward alone (jvp_fwd: the fused JVP forward's ms)."""
    q, k, v = (a.detach().requires_grad_() for a in (q, k, v))
    do = torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def jvp_step():
        o, _ = fa.jvp_attention(q, k, v, tq, tk, tv)
        return torch.autograd.grad(o, (q, k, v), do)

    def sdpa_step():
        return torch.autograd.grad(sdpa(q, k, v), (q, k, v), do)

    with torch.no_grad():
        sdpa_fwd = gpu_ms(lambda: sdpa(q, k, v))
    row = {"jvp_train_ms": gpu_ms(jvp_step), "sdpa_train_ms": gpu_ms(sdpa_step), "sdpa_fwd_ms": sdpa_fwd}
    row["jvp_bwd_ms"], row["sdpa_bwd_ms"] = row["jvp_train_ms"] - jvp_fwd, row["sdpa_train_ms"] - sdpa_fwd
    row["train_ratio"] = row["jvp_train_ms"] / row["sdpa_train_ms"]
    row["jvp_train_host_us"], row["sdpa_train_host_us"] = host_us(jvp_step), host_us(sdpa_step)
    return row


def backward_row(d: int, n: int, causal: bool, names, heads: int = 16, bh: int = 64, dtype=torch.bfloat16) -> dict:
    """ms per backward implementation at one shape, fed with flm's forward O and lse; None where it failed."""
    b = bh // heads
    q, k, v, do = (torch.randn(b, heads, n, d, device="cuda", dtype=dtype) for _ in range(4))
    scale = d**-0.5
    o, lse = torch.ops.flm.attention_fwd(q, k, v, causal, scale)
    row = {"head_dim": d, "tokens": n, "causal": causal, "batch": b, "heads": heads}
    for name in names:
        fn = lambda: triton_jvp.BACKWARDS[name](do, q, k, v, o, lse, causal, scale)  # noqa: E731
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            row[f"{name}_first_ms"] = (time.perf_counter() - t0) * 1e3
            row[f"{name}_ms"] = gpu_ms(fn)
        except (RuntimeError, TypeError) as e:  # cannot run here: the table says so
            row[f"{name}_first_ms"] = row[f"{name}_ms"] = None
            row[f"{name}_error"] = str(e).splitlines()[0][:80]
    torch.cuda.empty_cache()
    return row


def backward_table(rows, names) -> str:
    """The --backwards table: ms per implementation, speed-up over torch_fa2 (> 1: faster), first-call ms."""
    others = [n for n in names if n != "torch_fa2"]
    head = ["head dim", "tokens", "causal", *(f"{n} ms" for n in names), *(f"{n} speed-up vs torch_fa2" for n in others)]
    head += [f"{n} first call ms" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = r["torch_fa2_ms"]
        ratios = [None if base is None or r[f"{n}_ms"] is None else base / r[f"{n}_ms"] for n in others]
        cells = [r["head_dim"], r["tokens"], r["causal"], *(fmt(r[f"{n}_ms"], ".3f", "failed") for n in names)]
        cells += [fmt(x, ".2f", "-") + ("x" if x is not None else "") for x in ratios]
        cells += [fmt(r[f"{n}_first_ms"], ".0f", "failed") for n in names]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def train_table(rows) -> str:
    """Forward + backward, the fused JVP path against SDPA (FLOPs bound: (3 + 2.5) / (1 + 2.5) = 1.57x)."""
    lines = [
        "| head dim | tokens | fused JVP fwd ms | fused bwd ms | fused JVP fwd + bwd ms | SDPA fwd ms | SDPA bwd ms "
        "| SDPA fwd + bwd ms | ratio | fused fwd + bwd host us | SDPA fwd + bwd host us | host ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["head_dim"],
            r["tokens"],
            *(f"{r[key]:.3f}" for key in ("jvp_ms", "jvp_bwd_ms", "jvp_train_ms")),
            *(f"{r[key]:.3f}" for key in ("sdpa_fwd_ms", "sdpa_bwd_ms", "sdpa_train_ms")),
            f"{r['train_ratio']:.2f}x",
            f"{r['jvp_train_host_us']:.0f}",
            f"{r['sdpa_train_host_us']:.0f}",
            f"{r['jvp_train_host_us'] / r['sdpa_train_host_us']:.2f}x",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def fmt(x, spec=".1f", missing="OOM"):
    return missing if x is None else format(x, spec)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 72, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--backwards", nargs="+", choices=list(triton_jvp.BACKWARDS), help="time these backwards alone")
    ap.add_argument("--batch-heads", type=int, default=64, help="batch x heads of every row (a multiple of --heads)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for results.json and a plot")
    args = ap.parse_args(argv)
    if args.heads < 1 or args.batch_heads < args.heads or args.batch_heads % args.heads:
        ap.error(f"--batch-heads ({args.batch_heads}) must be a positive multiple of --heads ({args.heads})")
    props = torch.cuda.get_device_properties(0)
    if args.backwards:
        run_backwards(args, props)
        return

    peak = matmul_tflops()
    rows = []
    for d in args.head_dims:
        for n in args.tokens:
            rows.append(run_row(d, n, heads=args.heads, bh=args.batch_heads))
            print(json.dumps(rows[-1]), flush=True)

    print(f"\n{props.name}, torch {torch.__version__}, triton {triton.__version__}, bf16, batch x heads = {args.batch_heads}")
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s (ceiling)\n")
    print(
        "| head dim | tokens | fused JVP ms | fused JVP TFLOP/s | of matmul peak | FA2 fwd TFLOP/s | cuDNN fwd TFLOP/s "
        "| math JVP ms | speed-up vs math | fused MiB | math MiB | first call s | fused host us/call | tuned forward |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        speedup = None if r["math_ms"] is None else r["math_ms"] / r["jvp_ms"]
        print(
            f"| {r['head_dim']} | {r['tokens']} | {r['jvp_ms']:.3f} | {r['jvp_tflops']:.0f} | "
            f"{r['jvp_tflops'] / peak:.2f} | {fmt(r['fa2_tflops'], '.0f')} | {fmt(r['cudnn_tflops'], '.0f')} | "
            f"{fmt(r['math_ms'], '.2f')} | {fmt(speedup, '.1f')}x | {r['jvp_mib']:.0f} | {fmt(r['math_mib'], '.0f')} | "
            f"{r['first_call_s']:.1f} | {r['jvp_host_us']:.0f} | {r['fwd_config']} |"
        )
    print(f"\n{train_table(rows)}")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__, "matmul_tflops": peak}
        with open(os.path.join(args.out, "attention_bench.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        plot(rows, peak, os.path.join(args.out, "attention_bench.png"))


def run_backwards(args, props):
    names = ["torch_fa2", *(n for n in args.backwards if n != "torch_fa2")]
    rows = []
    for d in args.head_dims:
        for n in args.tokens:
            for causal in (False, True):
                rows.append(backward_row(d, n, causal, names, heads=args.heads, bh=args.batch_heads))
                print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{props.name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, bf16, batch x heads = {args.batch_heads}"
    )
    print("the fused attention's backward alone, fed with flm's O and lse\n")
    print(backward_table(rows, names))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"gpu": props.name, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
        with open(os.path.join(args.out, "attention_backward.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def plot(rows, peak, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for d in sorted({r["head_dim"] for r in rows}):
        rs = [r for r in rows if r["head_dim"] == d]
        n = [r["tokens"] for r in rs]
        axes[0].plot(n, [r["jvp_tflops"] for r in rs], "o-", label=f"fused JVP, D={d}")
        axes[0].plot(n, [r["fa2_tflops"] or float("nan") for r in rs], "x--", label=f"FA2 fwd, D={d}")
        axes[1].plot(n, [r["jvp_mib"] for r in rs], "o-", label=f"fused JVP, D={d}")
        axes[1].plot(n, [r["math_mib"] or float("nan") for r in rs], "x--", label=f"math JVP, D={d}")
    axes[0].axhline(peak, color="k", lw=0.8, label="bf16 matmul")
    axes[0].set(xscale="log", xlabel="tokens", ylabel="TFLOP/s", title="throughput (JVP counted as 3 fwd)")
    axes[1].set(xscale="log", yscale="log", xlabel="tokens", ylabel="MiB", title="peak memory beyond inputs")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
