"""Sample quality at equal GPU time: train each objective for the same GPU seconds, then FID of its
1-, 2- and many-step samplers from flm's own evaluate.py, and a grid of each.

    PYTHONPATH=. python benchmarks/quality.py --data-root data --inception fid/inception.pt --budget-s 215 \\
        --runs flow_matching:flow_matching:auto meanflow:meanflow:auto scm:scm:auto --out docs/quality
    PYTHONPATH=. python benchmarks/quality.py ... --runs mf_p05:meanflow:2100:objective.adaptive_p=0.5

Protocol (docs/quality.md): MNIST 28 x 28, the `experiment=mnist_<objective>` presets (DiT-S/2,
batch 256) with `attention=triton_jvp trainer.cuda_graph=true`, each trained for the same GPU time.
A run is NAME:OBJECTIVE:STEPS[:override,override...]. STEPS=auto first trains `--probe-steps` steps,
which gives the objective's steady ms/step, then resumes the run (bit-exactly) up to
budget / (ms/step) steps, the budget being `--budget-s`, or a quarter of it for a distilled student (issue
14's rule: a student gets at most a quarter of its teacher's GPU time); STEPS=<seconds>s (e.g. 51s) does the same
with its own budget (a run with MeanFlow's consistency curriculum, objective.alpha_steps=[start,end], is probed twice,
as given and with the curriculum off, and its steps before `end` are counted at the first probe's cost); a number
trains that many steps (cheaper when the step cost is known), and the table reports the GPU time measured either way
(each logged window's steps at its ms/step). Then `--n`
samples from each of `--weights` (the run's first EMA, an EMA by decay such as ema0.99, or raw): FID
against the MNIST test digits, and the digit classifier's label accuracy.

Distillation runs name their teacher's run folder, which an earlier run of the same call trained; `RUNS/` at the
start of an override's value stands for the `--work` folder:
    --runs fm:flow_matching:3500 scd:scd:51s:objective.teacher=RUNS/fm
When the table holds the teacher's run, a student's row also gives its GPU time with the teacher's: the whole
teacher-then-student pipeline, to set against one objective trained from scratch for the same time; and its FID over
the teacher's 50-step FID (issue 14's ratio), from the teacher's entry as it was when the student ran.

Single runs at this budget move by ~25 % in 1-step FID from changes that should not matter (docs/quality.md,
sixth day), so `--seeds 0 1 2` trains each run once per seed (NAME_s<seed>, `trainer.seed=<seed>`) and the report
adds the mean and range over the seeds of each run. `--extra-steps 50` also scores each run's sampler at 50 steps
(MeanFlow's many-step sampler tends to its velocity u(z, t, t): how good a flow it learned, against flow matching's).
`--flow-map-error N` also scores each distilled student against its teacher's 100-step Euler solution from N noises
(benchmarks/flow_map_error.py), with the first --weights.

`--parallel N` trains and scores N runs at once on the one GPU (runs of small steps leave it partly idle). Each run
must then give a step count, which makes its result the same as alone (training is deterministic), and must not
name a teacher trained in the same call; its ms/step and GPU s are then shares of a busy GPU, marked "(N at once)".

Results accumulate in <out>/quality.json (one entry per run, so runs can be made in separate calls)
and <out>/quality.md is rewritten from all entries each time.
"""

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from flm.log import read_metrics, training_seconds
from flm.train import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SAMPLER_STEPS = {
    "flow_matching": [50, 2],
    "meanflow": [1, 2],
    "scm": [1, 2],
    "scd": [1, 2],
    "rcm": [1, 2],
    "meanflow_distill": [1, 2],
    "meanflow_dmd": [1, 2],
    "meanflow_gan": [1, 2],
    "rcm_gan": [1, 2],
}


# students of a teacher: a flow map to compare with
DISTILLED = ("scd", "rcm", "rcm_gan", "meanflow_distill", "meanflow_dmd", "meanflow_gan")


def sh(args: list[str], log: str) -> str:
    """Run a command, its output appended to `log` and echoed; stop the benchmark if it fails. Returns the output."""
    print("+", " ".join(args), flush=True)
    with open(log, "a") as f:
        f.write("+ " + " ".join(args) + "\n")
        f.flush()
        proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(proc.stdout)
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode:
        sys.exit(f"error: command failed with exit code {proc.returncode}: {' '.join(args)} (log: {log})")
    return proc.stdout


def logged_windows(run_dir: str) -> list[dict]:
    """A run's logged windows (its metrics.jsonl records with a step time); at least two, the first holding compilation
    and capture."""
    rows = [r for r in read_metrics(run_dir) if "step_ms" in r]
    if len(rows) < 2:
        raise SystemExit(f"error: {run_dir}/metrics.jsonl has {len(rows)} logged windows; raise --probe-steps")
    return rows


def steady_step_ms(run_dir: str, rows: list[dict] | None = None) -> float:
    """The median ms/step of a run's logged windows after the first (which holds compilation and capture). Not the
    last window alone: a run's final window can be a few steps long and read 1-6 % slow (910 steps logged every
    50: 55.5-58.6 ms against 55.0-55.7 in the full windows of the same runs, docs/quality.md ninth day)."""
    rows = logged_windows(run_dir) if rows is None else rows
    return statistics.median(r["step_ms"] for r in rows[1:])


def steady_gpu_seconds(run_dir: str) -> float:
    """A run's training time (flm.log.training_seconds): each logged window's steps x its ms/step, the first window
    (compilation, capture) at the median of the others. A sum, not steps x median: a run whose steps change cost
    (MeanFlow's consistency curriculum, objective.alpha_steps, takes no JVP before its hand-over) is charged for each kind
    of step. In runs logged before the forty-sixth day a resumed run's first window (after a time budget's probe) holds
    its capture or compilation too, and is charged as logged; the loop now times each kind of step's first run apart
    (warmup_s), out of every window."""
    logged_windows(run_dir)  # at least two, or the --probe-steps advice
    return training_seconds(read_metrics(run_dir))[-1][1]


def cost_change(objective: str, overrides: list[str]) -> tuple[int, str, str] | None:
    """(end, key, neutral) of a run whose steps cost less before step `end`, else None: MeanFlow's consistency curriculum
    (objective.alpha_steps=[start,end]: no JVP before its hand-over) or a DMD start (objective.dmd_start: the
    distillation alone, no DMD forwards and no fake-score steps, before it). Read from the run's composed config, so a
    preset's own value counts as an override's does (mnist_rcm starts DMD at step 400). `key=neutral` makes every step
    the later kind."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment=mnist_{objective}", *overrides])
    alpha_steps, dmd_start = cfg.objective.get("alpha_steps"), cfg.objective.get("dmd_start")
    if alpha_steps is not None:
        return int(alpha_steps[1]), "objective.alpha_steps", "null"
    if dmd_start:
        return int(dmd_start), "objective.dmd_start", "0"
    return None


def steps_for_budget(budget_s: float, ms: float, end: int | None = None, ms_after: float | None = None) -> int:
    """Training steps in budget_s GPU seconds at ms per step, or with a curriculum its first `end` steps at ms and the
    rest at ms_after; a multiple of 10."""
    budget_ms = budget_s * 1000
    if end is not None and budget_ms > end * ms:
        return int(round((end + (budget_ms - end * ms) / ms_after) / 10)) * 10
    return int(round(budget_ms / ms / 10)) * 10


def budget_seconds(steps: str, objective: str, budget_s: float) -> float:
    """GPU seconds of training for STEPS=auto or <seconds>s: a distilled student's auto is a quarter of the budget."""
    if steps == "auto":
        return budget_s / 4 if objective in DISTILLED else budget_s
    return float(steps[:-1])


def seeded(spec: str, seed: int) -> str:
    """The run spec for one seed: NAME_s<seed>, trainer.seed=<seed> added to its overrides."""
    name, objective, steps, *rest = spec.split(":", 3)
    return ":".join([f"{name}_s{seed}", objective, steps, ",".join([*rest, f"trainer.seed={seed}"])])


def parse_spec(spec: str, work: str) -> tuple[str, str, str, list[str]]:
    """NAME:OBJECTIVE:STEPS[:override,...] -> (name, objective, steps, overrides), with RUNS/ at the start of an
    override's value made the run folders' `work` (the docs' commands write objective.teacher=RUNS/fm5)."""
    name, objective, steps, *rest = spec.split(":", 3)
    overrides = split_overrides(rest[0]) if rest else []
    return name, objective, steps, [expand_runs(o, work) for o in overrides]


def expand_runs(override: str, work: str) -> str:
    key, eq, value = override.partition("=")
    return f"{key}={os.path.join(work, value[len('RUNS/') :])}" if eq and value.startswith("RUNS/") else override


def run_objective(spec: str, args, group: str | None = None) -> dict:
    name, objective, steps, overrides = parse_spec(spec, args.work)
    run_dir = os.path.join(args.work, name)
    log = os.path.join(args.out, f"{name}.log")
    train = [
        sys.executable,
        "train.py",
        f"experiment=mnist_{objective}",
        f"attention={args.attention}",
        f"data.root={args.data_root}",
        "data.download=false",
        f"run_dir={run_dir}",
        "trainer.sample_every=0",
        "trainer.ckpt_every=0",
        "trainer.log_every=50",
        *overrides,
    ]
    if not any(o.startswith("trainer.cuda_graph=") for o in overrides):  # a run's own choice wins
        train.append(f"trainer.cuda_graph={str(args.cuda_graph).lower()}")
    start = time.time()
    if steps == "auto" or steps.endswith("s"):
        budget_s = budget_seconds(steps, objective, args.budget_s)
        probe = args.probe_steps if steps == "auto" else min(args.probe_steps, 100)
        # the probe's steps lie in the warm-up, which no decay touches; the resumed run decays to its own max_steps
        sh(train + [f"trainer.max_steps={probe}", "optim.decay=none"], log)
        change, end, ms_after = cost_change(objective, overrides), None, None
        if change is not None:  # cheaper steps until `end`: the later kind is probed apart, every step made that kind
            end, key, neutral = change
            if probe >= end:
                raise SystemExit(f"error: {name}'s {key} changes its step at step {end}, inside the {probe}-step probe")
            later_dir = f"{run_dir}-later-probe"
            plain = [a for a in train if not a.lstrip("+").startswith(("run_dir=", f"{key}="))]
            sh(plain + [f"{key}={neutral}", f"run_dir={later_dir}", f"trainer.max_steps={probe}", "optim.decay=none"], log)
            ms_after = steady_step_ms(later_dir)
        steps = max(probe, steps_for_budget(budget_s, steady_step_ms(run_dir), end, ms_after))
        if steps > probe:
            sh(train + [f"trainer.max_steps={steps}", "trainer.resume=auto"], log)
    else:
        steps = int(steps)
        sh(train + [f"trainer.max_steps={steps}"], log)
    ms_final = steady_step_ms(run_dir)
    wall = time.time() - start

    sampler_steps = run_sampler_steps(objective, args.extra_steps)
    fid = {}
    for i, weights in enumerate(args.weights):
        evals = os.path.join(args.out, f"{name}-{weights}-eval.json")
        sh(
            [
                sys.executable,
                "evaluate.py",
                f"ckpt={run_dir}",
                f"n={args.n}",
                f"steps=[{','.join(map(str, sampler_steps))}]",
                *weights_options(weights),
                f"grid={str(args.grids and i == 0).lower()}",
                f"batch_size={args.eval_batch}",
                f"precision={args.precision}",
                f"inception={args.inception}",
                f"data.root={args.data_root}",
                f"out={evals}",
            ],
            log,
        )
        with open(evals) as f:
            fid[weights] = json.load(f)
    distilled = objective in DISTILLED and args.flow_map_error
    flow_map = flow_map_error(run_dir, args.weights[0], args.flow_map_error, log) if distilled else None
    return {
        "name": name,
        "objective": objective,
        "sampler_steps": sampler_steps,
        "train_steps": steps,
        "step_ms": ms_final,
        "gpu_s": steady_gpu_seconds(run_dir),
        "teacher_gpu_s": teacher_seconds(overrides),  # the teacher as it was trained, not a later namesake
        "wall_s": wall,
        "overrides": overrides,
        "evals": fid,
        "flow_map_error": flow_map,
        "group": group or name,
        "parallel": args.parallel,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "triton": triton_version(),
        "command": " ".join(sys.argv),
    }


def check_parallel(specs: list[str], parallel: int, work: str) -> None:
    """Runs side by side must not time themselves (a time budget's probe would time a shared GPU) or wait for each
    other (a student whose teacher is trained in the same call)."""
    if parallel < 1:
        raise SystemExit(f"error: --parallel {parallel}: give 1 (one run at a time) or more")
    if parallel == 1:
        return
    folders = {os.path.normpath(os.path.join(work, spec.split(":", 1)[0])) for spec in specs}
    for spec in specs:
        name, _, steps, overrides = parse_spec(spec, work)
        if steps == "auto" or steps.endswith("s"):
            raise SystemExit(
                f"error: --parallel {parallel} needs step counts, and run {name} has {steps!r}: a time budget's probe "
                "would time a GPU shared with the other runs. Give NAME:OBJECTIVE:STEPS, or use --parallel 1"
            )
        teachers = [o.split("=", 1)[1] for o in overrides if o.startswith("objective.teacher=")]
        for teacher in teachers:
            if os.path.normpath(teacher) in folders:
                raise SystemExit(
                    f"error: --parallel {parallel}: run {name}'s teacher {teacher} is trained in the same call; train "
                    "the teacher in a call of its own (or with --parallel 1) first"
                )


def shared(r: dict, value: str) -> str:
    """A time column of a run trained beside others: a share of a busy GPU, not its own GPU time."""
    n = r.get("parallel", 1)
    return f"{value} ({n} at once)" if n > 1 else value


def flow_map_error(run_dir: str, weights: str, n: int, log: str) -> dict:
    """{sampler steps: mean squared distance per element to the teacher's solution} of a distilled student."""
    out = sh(
        [sys.executable, "benchmarks/flow_map_error.py", f"--ckpt={run_dir}", f"--n={n}", "--steps", "1", "2"]
        + fme_weights(weights),
        log,
    )
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| student |")]
    return {row[2].strip(): float(row[3]) for row in rows}


def fme_weights(weights: str) -> list[str]:
    """flow_map_error.py's options for a --weights entry: evaluate.py's, as flags of the same names."""
    return [f"--{option}" for option in weights_options(weights)]


def split_overrides(text: str) -> list[str]:
    """Hydra overrides separated by commas outside brackets: a,b=[0.99,0.999] -> [a, b=[0.99,0.999]]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p for p in parts + [text[start:]] if p]


def weights_options(weights: str) -> list[str]:
    """evaluate.py's options for a --weights entry: ema (the run's first EMA), ema<decay> or ema<name>, raw."""
    if weights == "raw":
        return ["weights=raw"]
    if weights == "ema":
        return ["weights=ema"]
    if weights.startswith("ema"):
        return ["weights=ema", f"ema={weights[3:]}"]
    raise SystemExit(f"error: --weights {weights!r}: expected ema, ema<decay> (ema0.99) or raw")


def evaluations(entry: dict) -> dict:
    """{weights: evaluate.py's report} of a run; entries written before --weights held one, of the first EMA."""
    return entry.get("evals") or {"ema": entry["eval"]}


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "-"
    return triton.__version__


def report(results: dict, path: str) -> None:
    # an entry added by hand (a call cut off before quality.py wrote it) says where its numbers come from in `note`
    lines = [
        f"- `{r['name']}`: {r['device']}, torch {r['torch']}, Triton {r['triton']}; `{r['command']}`"
        + (f" ({r['note']})" if r.get("note") else "")
        for r in results.values()
    ]
    lines += [
        "",
        "| run | objective | overrides | training steps | ms/step | GPU s | GPU s with teacher | weights | sampler steps "
        "| FID | label accuracy | digit FD | faint pixels | FID / best FM 50-step on its GPU | FID / its teacher's 50-step "
        "| flow-map error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # the ratio's baseline is the best 50-step flow-matching FID in the table (the strictest comparison) from a run on
    # the same kind of GPU: another card's arithmetic moves FID by a few percent (docs/quality.md, thirty-fifth day)
    base: dict[str, float] = {}
    for r in results.values():
        if r["objective"] == "flow_matching":
            for e in evaluations(r).values():
                if "fid_steps50" in e["results"]:
                    base[r["device"]] = min(base.get(r["device"], math.inf), e["results"]["fid_steps50"])
    for r in results.values():
        teacher_s = r.get("teacher_gpu_s") or (teacher_run(r, results) or {}).get("gpu_s")  # as recorded, else by name
        with_teacher = f"{r['gpu_s'] + teacher_s:.0f}" if teacher_s else "-"
        step_ms, gpu_s = shared(r, f"{r['step_ms']:.1f}"), shared(r, f"{r['gpu_s']:.0f}")
        for weights, report in evaluations(r).items():
            found = report["results"]
            for k in scored_steps(r):
                fid, acc = found[f"fid_steps{k}"], found.get(f"label_acc_steps{k}")
                ratio = f"{fid / base[r['device']]:.2f}" if r["device"] in base else "-"
                to_teacher = f"{fid / r['teacher_fid50']:.2f}" if r.get("teacher_fid50") else "-"
                acc = f"{100 * acc:.1f} %" if acc is not None else "-"
                fd = found.get(f"digit_fd_steps{k}")
                fd = f"{fd:.3f}" if fd is not None else "-"
                faint = found.get(f"faint_steps{k}")
                faint = f"{100 * faint:.2f} %" if faint is not None else "-"
                fme = (r.get("flow_map_error") or {}).get(str(k))
                fme = "-" if fme is None else f"{fme:.5f}"
                lines.append(
                    f"| {r['name']} | {r['objective']} | {' '.join(r['overrides']) or '-'} | {r['train_steps']} | "
                    f"{step_ms} | {gpu_s} | {with_teacher} | {weights} | {k} | {fid:.2f} | {acc} | {fd} | {faint} | {ratio} | {to_teacher} | {fme} |"
                )
    lines += seed_table(results)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def run_sampler_steps(objective: str, extra: list[int]) -> list[int]:
    """The objective's own sampler step counts, then those of `extra` (--extra-steps) it does not have."""
    own = SAMPLER_STEPS[objective]
    return own + [k for k in dict.fromkeys(extra) if k not in own]


def scored_steps(r: dict) -> list[int]:
    """The sampler step counts a run was scored at (entries written before --extra-steps: its objective's own)."""
    return r.get("sampler_steps") or SAMPLER_STEPS[r["objective"]]


def teacher_run(r: dict, results: dict) -> dict | None:
    """The entry of the run that a distilled run names as objective.teacher (by its folder's name), if the table holds
    it: a student's GPU time plus its teacher's is the whole pipeline's, to set against one run trained from scratch."""
    for o in r["overrides"]:
        if o.startswith("objective.teacher="):
            return results.get(os.path.basename(os.path.normpath(o.split("=", 1)[1])))
    return None


def teacher_seconds(overrides: list[str]) -> float | None:
    """The GPU seconds that a distilled run's teacher trained for, read from the teacher's own metrics.jsonl up to the
    checkpoint it is (a run folder's latest, or a checkpoint file: a two-stage split can take a longer run's earlier
    checkpoint). None without a teacher or a readable run beside its checkpoint."""
    teacher = next((o.split("=", 1)[1] for o in overrides if o.startswith("objective.teacher=")), None)
    if teacher is None:
        return None
    try:
        ckpt = checkpoint.find_checkpoint(teacher)
        step = checkpoint.step_of(ckpt)
        seconds = training_seconds(read_metrics(os.path.dirname(os.path.dirname(ckpt))))
    except (FileNotFoundError, ValueError):
        return None
    start, spent = 0, 0.0
    for end, total in seconds:  # a window's steps cost alike: a step inside one takes its share
        if step <= end:
            return spent + (total - spent) * (step - start) / (end - start)
        start, spent = end, total
    return None  # a checkpoint past the last logged window


def teacher_fid50(r: dict, results: dict) -> float | None:
    """The 50-step FID of a distilled run's teacher (its first evaluation), if the table holds the teacher: issue 14
    measures a student against its own teacher. Recorded with the student, since a later run may reuse the name."""
    teacher = teacher_run(r, results)
    if teacher is None:
        return None
    found = [e["results"]["fid_steps50"] for e in evaluations(teacher).values() if "fid_steps50" in e["results"]]
    return found[0] if found else None


def seed_table(results: dict) -> list[str]:
    """Mean and range of each metric over the seeds of every run made with --seeds (a group of two or more)."""
    groups: dict[str, list[dict]] = {}
    for r in results.values():
        groups.setdefault(r.get("group", r["name"]), []).append(r)
    lines = []
    for group, runs in groups.items():
        if len(runs) < 2:
            continue
        for weights in evaluations(runs[0]):
            for k in scored_steps(runs[0]):
                fids = [evaluations(r)[weights]["results"][f"fid_steps{k}"] for r in runs if weights in evaluations(r)]
                fmes = [r["flow_map_error"][str(k)] for r in runs if (r.get("flow_map_error") or {}).get(str(k)) is not None]
                fme = f"{sum(fmes) / len(fmes):.5f} ({min(fmes):.5f}-{max(fmes):.5f})" if fmes else "-"
                lines.append(
                    f"| {group} | {len(fids)} | {weights} | {k} | {sum(fids) / len(fids):.2f} | "
                    f"{min(fids):.2f}-{max(fids):.2f} | {fme} |"
                )
    if not lines:
        return []
    return [
        "",
        "Over seeds (`--seeds`):",
        "",
        "| run | seeds | weights | sampler steps | mean FID | FID range | flow-map error, mean (range) |",
        "|---|---|---|---|---|---|---|",
        *lines,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True, help="folder with MNIST/raw (torchvision layout)")
    p.add_argument("--inception", required=True, help="the FID Inception TorchScript file")
    p.add_argument(
        "--runs",
        nargs="+",
        default=[f"{k}:{k}:auto" for k in ("flow_matching", "meanflow", "scm")],  # distillation needs a teacher run
        help="NAME:OBJECTIVE:STEPS[:override,...], STEPS a number, auto (probe, then the budget) or <seconds>s",
    )
    p.add_argument("--budget-s", type=float, default=215.0, help="GPU seconds of training per objective")
    p.add_argument("--probe-steps", type=int, default=300, help="steps that measure ms/step before the budget is set")
    p.add_argument(
        "--weights", nargs="+", default=["ema"], help="weights to score: ema (the run's first EMA), ema<decay> (ema0.99), raw"
    )
    p.add_argument("--n", type=int, default=10_000, help="samples per FID")
    p.add_argument("--attention", default="triton_jvp", help="attention backend (math for a CPU dry run)")
    p.add_argument("--eval-batch", type=int, default=1000, help="evaluate.py's batch size")
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="evaluate.py's sampling precision (auto: bf16 autocast on CUDA; fp32 took 1.6-3.6 %% off few-step FIDs)",
    )
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--grids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a 100-image grid per sampler (of the first --weights)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="train each run once per seed (NAME_s<seed>)")
    p.add_argument(
        "--extra-steps",
        type=int,
        nargs="+",
        default=[],
        metavar="K",
        help="sampler step counts scored besides each objective's own (e.g. 50: MeanFlow's many-step sampler, which "
        "tends to its velocity u(z, t, t), against flow matching's 50-step FID)",
    )
    p.add_argument(
        "--flow-map-error", type=int, default=0, metavar="N", help="score distilled students against their teacher (N noises)"
    )
    p.add_argument(
        "--parallel", type=int, default=1, metavar="N", help="train and score N runs at once (step counts only; see above)"
    )
    p.add_argument("--work", default="/tmp/flm-quality", help="run folders")
    p.add_argument("--report-only", action="store_true", help="rewrite quality.md from quality.json, run nothing")
    p.add_argument("--out", default="docs/quality", help="quality.json, quality.md, logs and grids")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "quality.json")
    results = json.load(open(results_path)) if os.path.exists(results_path) else {}
    specs = [] if args.report_only else args.runs
    runs = (
        [(spec, None) for spec in specs]
        if args.seeds is None
        else [(seeded(spec, seed), spec.split(":", 1)[0]) for spec in specs for seed in args.seeds]
    )
    check_parallel([spec for spec, _ in runs], args.parallel, args.work)
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:  # each run is its own processes
        futures = [pool.submit(run_objective, spec, args, group) for spec, group in runs]
        for future in concurrent.futures.as_completed(futures):
            try:
                entry = future.result()
            except BaseException:
                for f in futures:  # a failed run stops the call, as one at a time; those running finish
                    f.cancel()
                raise
            entry["teacher_fid50"] = teacher_fid50(entry, results)  # the teacher as it is now, not a later namesake
            results[entry["name"]] = entry  # written as each run ends: a later failure keeps the earlier results
            with open(results_path, "w") as f:
                json.dump(results, f, indent=1)
    report(results, os.path.join(args.out, "quality.md"))


if __name__ == "__main__":
    main()
