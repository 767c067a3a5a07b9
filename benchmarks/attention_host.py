"""Host time of the fused attention, layer by layer (issue 16): where an eager forward + backward spends its CPU.

Each row times one layer of the call stack on its own, the outer ones including the inner ones, in microseconds of
host time per call (benchmarks/attention.py's host_us: short rounds of calls issued without waiting for the GPU; bf16,
batch x heads = 64), beside SDPA's forward, backward and both. A cProfile of the fused forward + backward follows (top
functions by own time; 10 rounds of 20 calls, the synchronisation between rounds is its own row). The chain rows run
12 attentions in a row (each output the next query) under one autograd.grad, as a network's blocks do: the engine's
entry and exit are paid once, and each call pays its own forward and its backward node. Where cuDNN's backward is flm's
(Hopper), the fused pair is timed again with FLM_ATTENTION_NATIVE_NODE=1 (aten's C++ node in place of flm's Function).

    PYTHONPATH=. python benchmarks/attention_host.py [--head-dims 64 72 128] [--tokens 4096] [--profile-out FILE] [--trace DIR]
"""

import argparse
import contextlib
import cProfile
import io
import os
import pstats

import torch
import triton

import flm.attention as fa
from benchmarks.attention import host_us
from flm.attention import native, triton_jvp
from flm.kernels import attention_fwd as kernels
from flm.kernels.attention_fwd import attention_fwd


CHAIN = 12  # a DiT-B's depth


def _own_launch(grid, args, constexprs, num_warps, num_stages):
    """Triton's own launch, `kernel[grid](...)`, in place of flm.kernels.launch.DirectLaunch."""
    kernels._fwd_kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


class _Double(torch.autograd.Function):
    """2 x, with a Python backward: what the autograd engine charges a Python Function on this device, apart from
    any work in it."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def layers(d: int, n: int, heads: int = 16, bh: int = 64):
    b = bh // heads
    q, k, v, tq, tk, tv = (torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(6))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(q)
    scale = d**-0.5
    o, _, lse = attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=scale)
    backward = triton_jvp.backward_impl(q)
    impl = f"fwd {kernels.last_choice()}, bwd {backward}"  # the tuner's choice for these shapes
    sdpa = torch.nn.functional.scaled_dot_product_attention
    so = sdpa(qg, kg, vg)

    def fused_step():
        o, _ = fa.jvp_attention(qg, kg, vg, tq, tk, tv)
        return torch.autograd.grad(o, (qg, kg, vg), do)

    def chain(attend, calls: int = CHAIN):
        """`calls` attentions in a row (each one's output the next one's query, as in a network), one autograd.grad:
        the engine's entry and exit are paid once, as in a training step, and each call pays its node's share."""
        x = qg
        for _ in range(calls):
            x = attend(x)
        return torch.autograd.grad(x, (qg, kg, vg), do)

    fused_attend = lambda x: fa.jvp_attention(x, kg, vg, tq, tk, tv)[0]  # noqa: E731
    sdpa_attend = lambda x: sdpa(x, kg, vg)  # noqa: E731

    def former(name, replacement):
        """attention_fwd with one of the former launch paths swapped back in for flm.kernels.attention_fwd's `name`."""
        kept = getattr(kernels, name)
        setattr(kernels, name, replacement)
        try:
            return attention_fwd(q, k, v, tq, tk, tv, causal=False, scale=scale)
        finally:
            setattr(kernels, name, kept)

    rows = {
        "torch.empty x 3 (for scale)": lambda: [torch.empty_like(q) for _ in range(3)],
        "fwd: attention_fwd (the kernel launch and its allocations)": lambda: attention_fwd(
            q, k, v, tq, tk, tv, causal=False, scale=scale
        ),
        "fwd: attention_fwd, pointer loads (tma=False)": lambda: attention_fwd(
            q, k, v, tq, tk, tv, causal=False, scale=scale, tma=False
        ),
        "fwd: attention_fwd, Triton's own launch of the tuned config (the former path)": lambda: former(
            "_fwd_launch", _own_launch
        ),
        "fwd: triton_jvp.jvp_attention (+ autograd.Function)": lambda: triton_jvp.jvp_attention(
            qg, kg, vg, tq, tk, tv, causal=False, scale=scale
        ),
        "fwd: flm.attention.jvp_attention (+ input checks)": lambda: fa.jvp_attention(qg, kg, vg, tq, tk, tv),
        "bwd: the backward in use, called directly": lambda: triton_jvp.BACKWARDS[backward](do, q, k, v, o, lse, False, scale),
        "bwd: _bwd_impl (+ choice of backward)": lambda: triton_jvp._bwd_impl(do, q, k, v, o, lse, False, scale),
        "fwd + bwd: fused, autograd.grad": fused_step,
        "SDPA fwd (no grad)": lambda: sdpa(q, k, v),
        "SDPA bwd: autograd.grad of a kept output": lambda: torch.autograd.grad(so, (qg, kg, vg), do, retain_graph=True),
        "SDPA fwd + bwd, autograd.grad": lambda: torch.autograd.grad(sdpa(qg, kg, vg), (qg, kg, vg), do),
        f"fused fwd + bwd, {CHAIN} in a chain, per call": lambda: chain(fused_attend),
        f"SDPA fwd + bwd, {CHAIN} in a chain, per call": lambda: chain(sdpa_attend),
        "2 x, native op, fwd + bwd": lambda: torch.autograd.grad(qg * 2, (qg,), do),
        "2 x, Python autograd.Function, fwd + bwd": lambda: torch.autograd.grad(_Double.apply(qg), (qg,), do),
    }
    # the same calls with FLM_ATTENTION_NATIVE_NODE=1 (flm.attention.native), where cuDNN's backward is flm's
    native_rows = {NATIVE: fused_step, NATIVE_CHAIN: lambda: chain(fused_attend)} if backward == "cudnn" else {}
    with native_node(True):
        if native_rows:
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused_step(), native_node(False)(fused_step)()))
            print(f"D={d}, N={n}: the native node's gradients against flm's Function's: max abs difference {err:.3g}")
        timed_native = {name: _timed(name, fn) for name, fn in native_rows.items()}
    timed = {name: _timed(name, fn) for name, fn in rows.items()} | timed_native
    steps = {"fused": fused_step}
    if native_rows:
        steps["native node"] = native_node(True)(fused_step)
    return timed, impl, steps


NATIVE = "fwd + bwd: fused, native node (FLM_ATTENTION_NATIVE_NODE=1), autograd.grad"
NATIVE_CHAIN = f"fused fwd + bwd, native node, {CHAIN} in a chain, per call"


def _timed(name: str, fn) -> float:
    # a chain in rounds of 2, not 20: 20 chains of launches would fill the launch queue and wait for the GPU
    return host_us(fn, calls=2, rounds=15) / CHAIN if "in a chain" in name else host_us(fn)


@contextlib.contextmanager
def native_node(on: bool):
    """FLM_ATTENTION_NATIVE_NODE set to `on` inside (also as a decorator), as it was after."""
    kept = os.environ.get(native.ENV)
    os.environ[native.ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if kept is None:
            del os.environ[native.ENV]
        else:
            os.environ[native.ENV] = kept


def trace(steps: dict, d: int, n: int, folder: str) -> list[str]:
    """A torch.profiler trace of 20 calls of each step (host activity only) into `folder`, and its op table by own
    time: the autograd engine's device thread records each backward node's evaluation, so the tables set the Python
    Function's node against cuDNN's native one."""
    os.makedirs(folder, exist_ok=True)
    tables = []
    for name, step in steps.items():
        step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(folder, f"host_d{d}_n{n}_{name.replace(' ', '_')}.json"))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        tables.append(f"## head dim {d}, {n} tokens, {name}: 20 calls, torch.profiler by own time\n{table}")
    return tables


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 72, 128])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--profile-out", default=None, help="also write the cProfile tables here")
    p.add_argument(
        "--trace",
        default=None,
        help="a folder: torch.profiler traces of 20 fused (and native-node) pairs per shape, "
        "whose op tables (the autograd thread's nodes among them) are printed too",
    )
    args = p.parse_args()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
        f"batch x heads = 64; host us per call (median of 9 rounds of 20 calls)\n"
    )
    results, impls, profiles, traces = {}, {}, [], []
    for d in args.head_dims:
        for n in args.tokens:
            results[(d, n)], impls[(d, n)], steps = layers(d, n)
            if args.trace:
                traces.extend(trace(steps, d, n, args.trace))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):  # short rounds: a full launch queue would make launches wait for the GPU
                for _ in range(20):
                    steps["fused"]()
                torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            profiles.append(f"## head dim {d}, {n} tokens: fused fwd + bwd x 200, by own time\n{s.getvalue()}")
    cols = list(results)
    print("| layer | " + " | ".join(f"D={d}, N={n}" for d, n in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name in results[cols[0]]:
        print(f"| {name} | " + " | ".join(f"{results[c].get(name, float('nan')):.0f}" for c in cols) + " |")
    fused, plain = "fwd + bwd: fused, autograd.grad", "SDPA fwd + bwd, autograd.grad"
    print("| fused / SDPA fwd + bwd | " + " | ".join(f"{results[c][fused] / results[c][plain]:.2f}x" for c in cols) + " |")
    fused, plain = f"fused fwd + bwd, {CHAIN} in a chain, per call", f"SDPA fwd + bwd, {CHAIN} in a chain, per call"
    print(
        f"| fused / SDPA, {CHAIN} in a chain | "
        + " | ".join(f"{results[c][fused] / results[c][plain]:.2f}x" for c in cols)
        + " |"
    )
    for label, with_node, sdpa in (("alone", NATIVE, "SDPA fwd + bwd, autograd.grad"), ("in a chain", NATIVE_CHAIN, plain)):
        ratios = [results[c][with_node] / results[c][sdpa] if with_node in results[c] else float("nan") for c in cols]
        print(f"| native node / SDPA, {label} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    print("| forward's tuned config and loads, backward in use | " + " | ".join(impls[c] for c in cols) + " |")
    text = "\n".join(profiles)
    if args.profile_out:
        with open(args.profile_out, "w") as f:
            f.write(text)
    print("\n" + text[:6000])
    print("\n".join(traces))


if __name__ == "__main__":
    main()
