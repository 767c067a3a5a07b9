"""FID against training steps, as measured: the in-loop evaluation (`trainer.eval_every`) that each run logged to its
metrics.jsonl, as a table and a plot (issue 11: a curve, not an extrapolation of one).

    python train.py ... trainer.eval_every=1000 'trainer.eval_steps=[1,2]' trainer.eval_inception=INCEPTION run_dir=RUN
    python benchmarks/fid_curve.py RUN [RUN ...] [--metric fid] [--x step|gpu_s] [--out DIR]

One column per run and sampler step count (`fid_steps<k>`, or `--metric label_acc` for `label_acc_steps<k>`, and so
on), one row per evaluated training step; a dash where a run did not evaluate at that step. `--x gpu_s` puts each
point at the run's seconds of training instead (flm.log.training_seconds: its logged windows' steps x ms/step, the
windows that hold compilation or an evaluation at the run's median), one row per point: runs of objectives whose steps
cost differently, compared at equal time. `--out DIR` writes DIR/<metric>_curve.md and, where matplotlib is installed,
DIR/<metric>_curve.png.
"""

import argparse
import os
import re
import sys

from flm.log import read_metrics, training_seconds


def series(run: str, metric: str) -> dict[str, dict[int, float]]:
    """{"<run> <k> steps": {training step: value}} for every `<metric>_steps<k>` the run logged."""
    pattern = re.compile(rf"{re.escape(metric)}_steps(\d+)$")
    found: dict[int, dict[int, float]] = {}
    for record in read_metrics(run):
        for key, value in record.items():
            m = pattern.match(key)
            if m:
                found.setdefault(int(m.group(1)), {})[int(record["step"])] = float(value)
    if not found:
        raise ValueError(
            f"{run} logged no {metric}_steps<k>: train it with trainer.eval_every=N (and trainer.eval_inception for FID)"
        )
    name = os.path.basename(os.path.normpath(run))
    return {f"{name} {k} step{'s' if k > 1 else ''}": points for k, points in sorted(found.items())}


def seconds_at(run: str):
    """step -> the run's seconds of training up to it, linear within each logged window."""
    ends = [(0, 0.0), *training_seconds(read_metrics(run))]

    def at(step: int) -> float:
        for (a, ta), (b, tb) in zip(ends, ends[1:]):
            if step <= b:
                return ta + (step - a) * (tb - ta) / (b - a)
        (a, ta), (b, tb) = ends[-2:]  # past the last window: at its rate
        return tb + (step - b) * (tb - ta) / (b - a)

    return at


def timed(curves: dict[str, dict[int, float]], runs: dict[str, str]) -> dict[str, dict[float, tuple[int, float]]]:
    """The curves keyed by seconds of training: {name: {seconds: (step, value)}}; runs: curve name -> its run folder."""
    clocks = {run: seconds_at(run) for run in set(runs.values())}
    return {name: {clocks[runs[name]](s): (s, v) for s, v in points.items()} for name, points in curves.items()}


def time_table(curves: dict[str, dict[float, tuple[int, float]]], metric: str) -> str:
    rows = sorted((sec, name, step, v) for name, points in curves.items() for sec, (step, v) in points.items())
    lines = [f"| GPU s of training | curve | training step | {metric} |", "|---|---|---|---|"]
    lines += [f"| {sec:.0f} | {name} | {step} | {v:.4g} |" for sec, name, step, v in rows]
    return "\n".join(lines)


def table(curves: dict[str, dict[int, float]], metric: str) -> str:
    steps = sorted({s for points in curves.values() for s in points})
    lines = [
        f"| training step | {' | '.join(f'{metric}, {name}' for name in curves)} |",
        "|---|" + "---|" * len(curves),
    ]
    for s in steps:
        cells = [f"{points[s]:.4g}" if s in points else "-" for points in curves.values()]
        lines.append(f"| {s} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(curves: dict[str, dict[float, float]], metric: str, path: str, x: str = "step") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        xs = sorted(points)
        ax.plot(xs, [points[s] for s in xs], "o-", label=name)
    label = "FID" if metric == "fid" else metric
    xlabel, against = ("training step", "training steps") if x == "step" else ("GPU seconds of training", "training time")
    ax.set(xlabel=xlabel, ylabel=label, title=f"{label} against {against} (as measured)")
    if metric == "fid" and all(v > 0 for points in curves.values() for v in points.values()):
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="train.py run folders that evaluated in training (trainer.eval_every)")
    p.add_argument("--metric", default="fid", help="fid, label_acc, digit_fd or faint: what the evaluation logged")
    p.add_argument("--x", choices=("step", "gpu_s"), default="step", help="training steps, or seconds of training")
    p.add_argument("--out", default=None, help="folder for <metric>_curve.md and .png")
    args = p.parse_args(argv)
    curves, runs = {}, {}
    try:
        for run in args.runs:
            found = series(run, args.metric)
            curves.update(found)
            runs.update(dict.fromkeys(found, run))
        if args.x == "gpu_s":
            by_time = timed(curves, runs)
            report = time_table(by_time, args.metric)
            curves = {name: {sec: v for sec, (_, v) in points.items()} for name, points in by_time.items()}
        else:
            report = table(curves, args.metric)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        command = f"python benchmarks/fid_curve.py {' '.join(args.runs)} --metric {args.metric} --x {args.x}"
        with open(os.path.join(args.out, f"{args.metric}_curve.md"), "w") as f:
            f.write(f"    {command}\n\n{report}\n")
        plot(curves, args.metric, os.path.join(args.out, f"{args.metric}_curve.png"), args.x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
