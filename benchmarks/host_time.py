"""Host time: what one call of each flm.nn layer, the attention entry and one eager training step cost the host.

At these sizes the device work is negligible, so wall time is host time (Python, dispatch, autograd): the part of
an eager step that CUDA graphs remove (docs/train_step.md). Layer rows time `--calls` calls on plain tensors and on
forward-AD duals; step rows time a deep, narrow DiT (`--depth` blocks like DiT-B/2's 12, width 64, 16 tokens,
batch 2) through each objective's loss, backward and AdamW step. Medians of `--repeats` timings.

    PYTHONPATH=. python benchmarks/host_time.py                         # CPU (math attention)
    PYTHONPATH=. python benchmarks/host_time.py --device cuda --backends math,triton_jvp
    PYTHONPATH=. python benchmarks/host_time.py --calls 1 --casts each,bulk   # the parameters' casts under bf16
"""

import argparse
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (the triton_jvp rows are for CUDA: the interpreter is not host time)

from torch.autograd import forward_ad

from flm import nn as fnn
from flm.attention import attention
from flm.models import DiT
from flm.objectives import build_objective


def median_us(fn, calls: int, repeats: int, sync) -> float:
    for _ in range(max(1, calls // 10)):
        fn()
    runs = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def layer_rows(device, calls, repeats, sync, backends):
    r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    x, w, b, g = r(2, 16, 64), r(64, 64), r(64), r(2, 1, 64)
    q = r(2, 2, 16, 32)  # (B, H, N, D); the attention rows take it as q, k and v
    rows = {
        "linear": lambda a: fnn.linear(a, w, b),
        "layer_norm": lambda a: fnn.layer_norm(a),
        "gelu_tanh": lambda a: fnn.gelu_tanh(a),
        "gated residual": lambda a: fnn.gated_residual(a, g, a),
    }
    for name in backends:
        rows[f"attention ({name})"] = lambda a, name=name: attention(a, a, a, backend=name)
    out = []
    for name, op in rows.items():
        arg = q if name.startswith("attention") else x
        plain = median_us(lambda op=op, arg=arg: op(arg), calls, repeats, sync)
        with forward_ad.dual_level():
            d = forward_ad.make_dual(arg, torch.randn_like(arg))
            dual = median_us(lambda op=op, d=d: op(d), calls, repeats, sync)
        out.append((name, plain, dual))
    return out


def step_rows(device, depth, objectives, backends, steps, repeats, sync, casts=("fp32",)):
    """(objective, backend, casts, ms) per step. casts: fp32 (no autocast), each (bf16 autocast,
    trainer.bulk_casts=false: one cast of each parameter per loss and one of its gradient) or bulk (bf16, the loop's
    default: all parameters in one op, all gradients in one; flm.nn.cast_cache). The kinds are timed in alternating
    rounds."""
    out = []
    for backend in backends:
        for name in objectives:
            torch.manual_seed(0)
            jvp = name != "flow_matching"
            model = DiT(  # 64 wide, 2 heads of 32, patch 2 on 8 x 8: the device work stays negligible
                input_size=8,
                in_channels=4,
                patch_size=2,
                hidden_size=64,
                depth=depth,
                num_heads=2,
                num_classes=10,
                time_inputs=2 if name == "meanflow" else 1,
                attention=backend,
            ).to(device)
            objective = build_objective(name, **({"jvp_mode": "dual"} if jvp else {}))
            params = list(model.parameters())
            opt = torch.optim.AdamW(params, lr=1e-4)
            x, y = torch.randn(2, 4, 8, 8, device=device), torch.randint(0, 10, (2,), device=device)

            def step(kind):
                bf16 = kind != "fp32"
                with (
                    torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
                    fnn.cast_cache(bf16, params if kind == "bulk" else ()),
                ):
                    loss, _ = objective.loss(model, x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            times = {kind: [] for kind in casts}
            for _ in range(repeats):  # alternating: the host's speed drifts within minutes
                for kind in casts:
                    times[kind].append(median_us(lambda kind=kind: step(kind), steps, 1, sync) / 1e3)
            out += [(name, backend, kind, statistics.median(times[kind])) for kind in casts]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--device", default="cpu")
    p.add_argument("--backends", type=csv, default=["math"], help="attention backends (triton_jvp: CUDA)")
    p.add_argument("--objectives", type=csv, default=["flow_matching", "meanflow", "scm"])
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--calls", type=int, default=2000, help="calls per layer timing")
    p.add_argument("--steps", type=int, default=20, help="steps per step timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--casts",
        type=csv,
        default=["fp32"],
        help="step rows: fp32 (no autocast), each and/or bulk (bf16 autocast; the parameters' casts)",
    )
    args = p.parse_args(argv)
    for kind in args.casts:
        if kind not in ("fp32", "each", "bulk"):
            p.error(f"--casts {kind!r} is not one of fp32, each, bulk")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but this machine has no CUDA GPU; leave --device at cpu")
    if "triton_jvp" in args.backends and device.type != "cuda":
        raise SystemExit("error: --backends triton_jvp times the GPU launch path: pass --device cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n| layer (1 call) | plain, us | dual, us |\n|---|---|---|")
    for layer, plain, dual in layer_rows(device, args.calls, args.repeats, sync, args.backends):
        print(f"| {layer} | {plain:.1f} | {dual:.1f} |")
    print(f"\n| eager step, DiT depth {args.depth}, width 64, 16 tokens x 2 | attention | casts | ms |\n|---|---|---|---|")
    rows = step_rows(device, args.depth, args.objectives, args.backends, args.steps, args.repeats, sync, args.casts)
    for objective, backend, kind, ms in rows:
        print(f"| {objective} | {backend} | {kind} | {ms:.2f} |")


if __name__ == "__main__":
    main()
