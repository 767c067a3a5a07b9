"""Training-step cost of flow matching, MeanFlow, sCM and the distillations sCD / rCM on a DiT: time and peak memory.

One step = objective.loss (forward, with the JVP for MeanFlow / sCM) + backward + AdamW step, bf16
autocast, class-conditional (1000 classes), 4 latent channels, image side = patch * sqrt(tokens),
batch = --batch-tokens / tokens. Every model uses the flm.nn layers. Flow-matching rows run the
row's attention backend on plain tensors (triton_jvp: its Triton FlashAttention forward + FA2
backward; math: eager). One extra flow-matching row per model/tokens uses PyTorch SDPA (`sdpa`), the
fastest plain baseline. Ratios: to the flow-matching step of the same model/tokens/backend, and to
the SDPA flow-matching step. Median of --iters timed steps after --warmup steps (Triton autotuning
happens in the warm-up). A row that runs out of memory prints OOM. `--exec graph` replays the loss and
backward as one CUDA graph (flm.train.graphs; the optimizer stays eager), which takes Python's kernel
issuing out of the step time: eager DiT-B steps are host-bound (see the host ms column).
sCD's step is the teacher's forward (no gradient, bf16) + the student's JVP + backward; its teacher is a
randomly initialised DiT of the student's size (the cost does not depend on the weights). An rCM row is
one cycle of its alternation: a fake-score step (student sample + fake-score flow-matching step) plus a
student step (sCD + the DMD term's teacher and fake-score forwards); under `--exec graph` each of the
two is its own CUDA graph, as in the loop. `--exec compile` runs torch.compile over the objective's
loss (JVP objectives with jvp_mode func and math or triton_jvp attention: Dynamo traces torch.func.jvp, flm.nn's
layers are their plain ops under compile, and the fused kernel's JVP op has an autograd formula for compiled code).

    PYTHONPATH=. python benchmarks/train_step.py                                    # full table (H200)
    PYTHONPATH=. python benchmarks/train_step.py --models DiT-B/2 --tokens 1024,4096 --backends triton_jvp
    PYTHONPATH=. python benchmarks/train_step.py --objectives flow_matching,meanflow --modes dual --out docs/x.md
    PYTHONPATH=. python benchmarks/train_step.py --exec eager,graph --models DiT-B/2 --tokens 1024
    PYTHONPATH=. python benchmarks/train_step.py --models DiT-B/2 --tokens 1024 --objectives flow_matching,scd,rcm \
        --backends triton_jvp --modes dual --exec eager,graph                       # distillation (issue 14)
    PYTHONPATH=. python benchmarks/train_step.py --exec eager,compile --backends math,triton_jvp --tokens 256
    PYTHONPATH=. python benchmarks/train_step.py --objectives flow_matching,meanflow,meanflow:jvp_subset=true
    PYTHONPATH=. python benchmarks/train_step.py --models DiT-B/2 --tokens 1024 --objectives meanflow,scm \
        --backends triton_jvp --modes dual --exec eager,graph --rounds 8           # eager / graph through host noise
    PYTHONPATH=. python benchmarks/train_step.py --models DiT-S/2 --tokens 196 --batch-tokens 25088 --channels 1 \
        --num-classes 10 --objectives flow_matching --backends triton_jvp --exec graph --profile  # GPU time by kernel kind
    PYTHONPATH=. python benchmarks/train_step.py --tiny                             # CPU smoke check

An objective is NAME or NAME:KEY=VALUE[;KEY=VALUE...], its options as in configs/objective (the row is labelled
with the whole string); the others keep the class's defaults (MeanFlow's: the whole batch takes the JVP).
"""

import argparse
import ast
import functools
import gc
import math
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on the CPU (before triton loads)

from benchmarks.quality import split_overrides
from flm import nn as fnn
from flm.models import build_model
from flm.objectives import build_objective
from flm.train.graphs import GraphedStep
from flm.train.loop import frozen

JVP_OBJECTIVES = ("meanflow", "scm", "scd", "rcm", "meanflow_dmd")
DISTILLATION = ("scd", "rcm", "meanflow_dmd")


def split_objective(spec: str) -> tuple[str, dict]:
    """("meanflow", {"jvp_subset": True}) of "meanflow:jvp_subset=true"."""
    name, _, options = spec.partition(":")
    kwargs = {}
    for option in filter(None, options.split(";")):
        key, eq, value = option.partition("=")
        if not eq:
            raise SystemExit(f"error: objective option {option!r} of {spec!r} is not KEY=VALUE")
        value = {"true": "True", "false": "False", "null": "None"}.get(value, value)
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value  # a string option (e.g. tangent=model)
    return name, kwargs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--models", type=csv, default=["DiT-B/2", "DiT-XL/2"])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in csv(s)], default=[256, 1024, 4096])
    # commas inside brackets belong to an option's list: meanflow:alpha_steps=[0,2000000]
    p.add_argument("--objectives", type=split_overrides, default=["flow_matching", "meanflow", "scm"])
    p.add_argument("--backends", type=csv, default=["triton_jvp", "math"], help="attention backends")
    p.add_argument("--modes", type=csv, default=["dual", "two_pass"], help="JVP modes (MeanFlow, sCM)")
    p.add_argument("--no-sdpa-baseline", action="store_true", help="skip the SDPA flow-matching row")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens * batch per step")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every row this many times, the rows interleaved (all built at once: more memory), and report the "
        "median of the rounds' medians and their range: an eager step's host speed moves 15-30 %% within minutes",
    )
    p.add_argument("--out", default=None, help="also write the table (Markdown) to this file")
    p.add_argument(
        "--exec",
        type=csv,
        default=["eager"],
        help="eager, graph (loss + backward as one CUDA graph) and/or compile (torch.compile over the loss; JVP mode func); "
        "compile:MODE passes torch.compile's mode, e.g. compile:reduce-overhead (CUDA graphs over the compiled code)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="print torch.profiler's top ops for each row and, on a GPU, its kernels' time per step by kind (matmul, attention, copies, ...)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="for eager rows, a cProfile of 5 steps: the top functions by cumulative and by own time, to see where the "
        "host's time goes (the profiler itself slows Python ~2x; read the shares, not the times)",
    )
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="an 'aten ops' column: the aten ops one eager step dispatches (casts in brackets), what its host time scales "
        "with. On the CPU triton_jvp runs in Triton's interpreter, whose copies of each launch's arguments (set_, new_empty) "
        "count too, as does the optimizer's unfused update: count on a GPU",
    )
    p.add_argument(
        "--casts",
        choices=["each", "bulk"],
        default="bulk",
        help="the trainable parameters' autocast casts: bulk (the loop's default, trainer.bulk_casts=true: one op for "
        "all of them, one for all their gradients) or each (trainer.bulk_casts=false: one cast per parameter and one "
        "per gradient)",
    )
    p.add_argument("--tiny", action="store_true", help="CPU smoke check: DiT-T/2, 16 tokens, fp32, 2 steps")
    p.add_argument(
        "--bf16", action="store_true", help="bf16 autocast on the CPU too: --count-ops as on a GPU (CPU bf16 times mean little)"
    )
    args = p.parse_args(argv)
    from flm.train.settings import COMPILE_MODES

    valid = ["eager", "graph", "compile", *(f"compile:{mode}" for mode in COMPILE_MODES)]
    for execution in args.exec:
        if execution not in valid:
            p.error(f"--exec {execution!r} is not one of {', '.join(valid)}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.tiny:
        args.models, args.tokens, args.batch_tokens, args.num_classes = ["DiT-T/2"], [16], 32, 10
        args.iters, args.warmup = 2, 1
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(err: Exception) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def build_step(model_name, tokens, objective_name, backend, mode, execution, args, device, dtype):
    """(step, batch) of one configuration, warmed up; step(i) runs one training step. Raises on OOM."""
    from flm.models import MODEL_SIZES

    patch = MODEL_SIZES[model_name][3]
    side = patch * math.isqrt(tokens)
    if side * side != patch * patch * tokens:
        raise ValueError(f"tokens {tokens} is not a square number; use e.g. 256, 1024, 4096")
    batch = max(1, args.batch_tokens // tokens)
    objective_name, kwargs = split_objective(objective_name)
    if objective_name in JVP_OBJECTIVES:
        kwargs["jvp_mode"] = mode
    if objective_name in DISTILLATION:
        kwargs["teacher"] = "benchmark"  # never read: the networks are built here, not from a checkpoint
    objective = build_objective(objective_name, **kwargs).to(device)
    build = functools.partial(
        build_model, model_name, input_size=side, in_channels=args.channels, num_classes=args.num_classes, attention=backend
    )
    with torch.device(device):
        model = build(time_inputs=objective.time_inputs, velocity_head=getattr(objective, "velocity_head", False))
    params = list(model.parameters()) + list(objective.parameters())
    fused = device.type == "cuda"
    opts = [torch.optim.AdamW(params, lr=1e-4, fused=fused)]
    networks = {}  # the objective's extra networks: flow-matching networks of the student's size (teacher, fake score)
    for name, network in getattr(objective, "networks", {}).items():
        with torch.device(device):
            networks[name] = build(time_inputs=1)
        if not network.trainable:  # as the training loop runs a teacher (its linear weights in bf16 on a GPU)
            networks[name] = frozen(networks[name], network, device, parallel="ddp")
        else:
            params = params + list(networks[name].parameters())
            opts.append(torch.optim.AdamW(networks[name].parameters(), lr=1e-4, fused=fused))
    # rCM: one cycle of its alternation (fake-score steps, then a student step), each phase its own graph
    phases = [objective.phase(k) for k in range(objective.fake_updates + 1)] if hasattr(objective, "fake_updates") else [None]
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, args.channels, side, side, device=device, generator=g)
    y = torch.randint(0, args.num_classes, (batch,), device=device, generator=g)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    # --exec compile: the loss (JVP included: jvp_mode func) is compiled, its backward is AOTAutograd's
    compiled = execution.startswith("compile")
    compile_mode = execution.partition(":")[2] or "default"
    objective_loss = torch.compile(objective.loss, mode=compile_mode) if compiled else objective.loss
    step_arg = torch.tensor(10**6, device=device) if compiled else 10**6  # past the warm-up
    in_bulk = params if args.casts == "bulk" and not compiled else ()

    def loss_and_backward(x, y, phase=None):
        if compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the next replay overwrites this one's outputs
        with autocast, fnn.cast_cache(True, in_bulk):  # as the training loop: one cast of each parameter per loss
            phase_arg = {} if phase is None else {"phase": phase}
            loss, metrics = objective_loss(model, x, y, step=step_arg, **phase_arg, **networks)
        loss = sum(loss.values()) if isinstance(loss, dict) else loss  # {network: loss}: each touches its own
        loss.backward()
        return loss, metrics

    forward_backward = {phase: functools.partial(loss_and_backward, phase=phase) for phase in phases}
    if execution == "graph":
        forward_backward = {phase: GraphedStep(fn, params) for phase, fn in forward_backward.items()}

    def step(i):
        for phase in phases:
            forward_backward[phase](x, y)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        step(i)
    return step, batch


def timed(step, iters: int, device) -> tuple[float, float]:
    """Medians of (ms per step, host ms per step) over iters steps."""
    _sync(device)
    times, host = [], []
    for i in range(iters):
        t0 = time.perf_counter()
        step(i)
        host.append(1e3 * (time.perf_counter() - t0))  # ~ times: the step is bound by Python, not the GPU
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), statistics.median(host)


class Row:
    """One configuration's measurements: its first round builds it (peak memory: what it allocates), each round
    times --iters steps."""

    def __init__(self, config, args, device, dtype):
        self.config, self.ms, self.host, self.step, self.peak, self.ops = config, [], [], None, None, None
        self.batch = max(1, args.batch_tokens // config[1])
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            # from the first step on: a CUDA graph allocates its activations once, at capture (in the warm-up)
            torch.cuda.reset_peak_memory_stats(device)
        try:
            self.step, self.batch = build_step(*config, args, device, dtype)
            self.time(args, device)
        except Exception as err:
            if not _is_oom(err):
                raise
            self.release(device)  # OOM: no numbers
            return
        if device.type == "cuda":
            self.peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
        else:
            self.peak = float("nan")
        if args.profile:
            _profile(self.step, device)
        if args.host_profile and config[-1] == "eager":
            _host_profile(self.step, device, " ".join(map(str, config)))
        if args.count_ops and config[-1] == "eager":
            self.ops = count_ops(self.step)

    def time(self, args, device) -> None:
        ms, host = timed(self.step, args.iters, device)
        self.ms.append(ms)
        self.host.append(host)

    def release(self, device) -> None:
        self.step = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def count_ops(step) -> tuple[int, int]:
    """(aten ops, of which dtype casts) that one step dispatches, optimizer included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.casts += func.overloadpacket is torch.ops.aten._to_copy
            return func(*args, **(kwargs or {}))

    with Count() as counter:
        step(0)
    return counter.ops, counter.casts


# GPU kernels by what they do, first match wins: a kernel's name carries its op (cuBLAS's nvjet/gemm, cuDNN's sdpa,
# PyTorch's functor in the template arguments: direct_copy, layer_norm, reduce, ...; inductor's triton_ prefix)
KERNEL_KINDS = (
    ("attention", ("sdpa", "flash", "fmha", "attention", "_fwd_kernel", "_bwd_dkdv", "_bwd_dq")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "matmul")),
    ("fused by inductor", ("triton_",)),
    ("optimizer", ("multi_tensor_apply", "adam", "fused_adam")),
    ("norm", ("layer_norm", "group_norm", "rms_norm", "_ln_")),
    ("copy and cast", ("direct_copy", "copy_kernel", "cat_", "catarraybatched")),
    ("reduction", ("reduce_kernel", "reduce_", "softmax")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_summary(kernels, steps: int) -> str:
    """Markdown table of GPU time per step by kind, from (name, total us, calls) triples, with each kind's largest
    kernel (its name cut to 90 characters)."""
    by_kind: dict[str, list] = {}
    for name, us, calls in kernels:
        by_kind.setdefault(kernel_kind(name), []).append((us, calls, name))
    total = sum(us for _, us, _ in kernels) or 1.0
    lines = ["| kernels | ms / step | share | launches / step | largest |", "|---|---|---|---|---|"]
    for kind, rows in sorted(by_kind.items(), key=lambda kv: -sum(r[0] for r in kv[1])):
        us = sum(r[0] for r in rows)
        top = max(rows)[2]
        lines.append(
            f"| {kind} | {us / 1000 / steps:.2f} | {us / total:.0%} | {sum(r[1] for r in rows) / steps:.0f} | `{top[:90]}` |"
        )
    return "\n".join(lines)


def _profile(step, device, rows: int = 12, steps: int = 2):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        _sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    averages = prof.key_averages()
    print(averages.table(sort_by=sort, row_limit=rows, max_name_column_width=120), flush=True)
    if device.type == "cuda":
        kernels = [(e.key, e.self_device_time_total, e.count) for e in averages if e.self_device_time_total > 0]
        kernels = [k for k in kernels if not k[0].startswith(("## Call", "Torch-Compiled", "autograd::", "Compiled"))]
        print(kernel_summary(kernels, steps), flush=True)


def _host_profile(step, device, label: str, steps: int = 5, rows: int = 30) -> None:
    import cProfile
    import io
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        step(i)
    prof.disable()
    _sync(device)
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(rows)
        print(f"## {label}: {steps} eager steps by {order} time\n{out.getvalue()}", flush=True)


def rows_to_run(args):
    """(model, tokens, objective, backend, mode) in table order; flow matching first in each group."""
    for model_name in args.models:
        for tokens in args.tokens:
            for execution in args.exec:
                if "flow_matching" in args.objectives and not args.no_sdpa_baseline:
                    yield model_name, tokens, "flow_matching", "sdpa", "-", execution
                for backend in args.backends:
                    for objective in args.objectives:
                        jvp_objective = split_objective(objective)[0] in JVP_OBJECTIVES
                        compiled = execution.startswith("compile")
                        if compiled and jvp_objective and backend not in ("math", "triton_jvp"):
                            continue  # a compiled JVP takes math or the fused kernel (flm.train.settings.check_compile)
                        modes = ["func"] if compiled else args.modes  # Dynamo traces torch.func.jvp only
                        for mode in modes if jvp_objective else ["-"]:
                            yield model_name, tokens, objective, backend, mode, execution


def _ratio(a, b):
    return "-" if a is None or b is None or not (b > 0) or math.isnan(a) else f"{a / b:.2f}x"


def table_line(row: Row, fm: dict, with_range: bool = False, count_ops: bool = False) -> str:
    """The row's table line (printed); fm collects the flow-matching rows that later rows are set against."""
    model_name, tokens, objective, backend, mode, execution = row.config
    ms = None if row.peak is None else statistics.median(row.ms)
    host = None if row.peak is None else statistics.median(row.host)
    if objective == "flow_matching":
        fm[model_name, tokens, backend, execution] = (ms, row.peak)
    base = fm.get((model_name, tokens, backend, execution), (None, None))
    sdpa = fm.get((model_name, tokens, "sdpa", execution), (None, None))
    cells = [
        model_name,
        f"{tokens} x {row.batch}",
        execution,
        objective,
        backend,
        mode,
        "OOM" if ms is None else f"{ms:.1f}",
        *([("-" if ms is None else f"{min(row.ms):.1f}-{max(row.ms):.1f}")] if with_range else []),
        "-" if host is None else f"{host:.1f}",
        "OOM" if row.peak is None else ("n/a" if math.isnan(row.peak) else f"{row.peak:.2f}"),
        _ratio(ms, base[0]),
        _ratio(row.peak, base[1]),
        _ratio(ms, sdpa[0]),
        _ratio(row.peak, sdpa[1]),
        *([("-" if row.ops is None else f"{row.ops[0]} ({row.ops[1]})")] if count_ops else []),
    ]
    line = "| " + " | ".join(cells) + " |"
    print(line, flush=True)
    return line


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.bf16 or not (args.tiny or device.type == "cpu") else torch.float32
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    rounds = "" if args.rounds == 1 else f", {args.rounds} interleaved rounds (median of their medians; ms range: theirs)"
    header = [
        f"# Training step: {gpu}, torch {torch.__version__}, triton {triton.__version__}, {str(dtype).split('.')[1]} "
        f"autocast, {args.channels} channels, {args.num_classes} classes, tokens x batch = {args.batch_tokens}, "
        f"AdamW, median of {args.iters} steps after {args.warmup}{rounds}",
        "",
        "Flow-matching rows run the row's backend on plain tensors (triton_jvp: Triton FlashAttention forward "
        "+ FA2 backward); `sdpa` is PyTorch SDPA. Ratios: to flow matching with the same backend, and to "
        "flow matching with SDPA. host ms: time for Python to issue the step (close to ms / step: host-bound).",
        "",
        "| model | tokens x batch | exec | objective | attention | JVP mode | ms / step |"
        + (" ms range |" if args.rounds > 1 else "")
        + " host ms | peak GiB | time / FM | mem / FM | time / FM sdpa | mem / FM sdpa |"
        + (" aten ops (casts) |" if args.count_ops else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if args.rounds > 1 else "")
        + ("---|" if args.count_ops else ""),
    ]
    print("\n".join(header), flush=True)
    lines, fm, rows = list(header), {}, []
    for config in rows_to_run(args):
        rows.append(Row(config, args, device, dtype))
        if args.rounds == 1:
            rows[-1].release(device)
            lines.append(table_line(rows[-1], fm, count_ops=args.count_ops))
    for _ in range(args.rounds - 1):
        for row in rows:
            if row.step is not None:
                row.time(args, device)
    if args.rounds > 1:
        for row in rows:
            lines.append(table_line(row, fm, with_range=True, count_ops=args.count_ops))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
