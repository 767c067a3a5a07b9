"""FID against training steps, as measured: the in-loop evaluation (`trainer.eval_every`) that each run logged to its
metrics.jsonl, as a table and a plot (issue 11: a curve, not an extrapolation of one).

    python train.py ... trainer.eval_every=1000 'trainer.eval_steps=[1,2]' trainer.eval_inception=INCEPTION run_dir=RUN
    python benchmarks/fid_curve.py RUN [RUN ...] [--metric fid] [--out DIR]

One column per run and sampler step count (`fid_steps<k>`, or `--metric label_acc` for `label_acc_steps<k>`, and so
on), one row per evaluated training step; a dash where a run did not evaluate at that step. `--out DIR` writes
DIR/<metric>_curve.md and, where matplotlib is installed, DIR/<metric>_curve.png.
"""

import argparse
import os
import re
import sys

from flm.log import read_metrics


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


def plot(curves: dict[str, dict[int, float]], metric: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], "o-", label=name)
    label = "FID" if metric == "fid" else metric
    ax.set(xlabel="training step", ylabel=label, title=f"{label} against training steps (as measured)")
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
    p.add_argument("--out", default=None, help="folder for <metric>_curve.md and .png")
    args = p.parse_args(argv)
    curves = {}
    try:
        for run in args.runs:
            curves.update(series(run, args.metric))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    report = table(curves, args.metric)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.metric}_curve.md"), "w") as f:
            f.write(f"    python benchmarks/fid_curve.py {' '.join(args.runs)} --metric {args.metric}\n\n{report}\n")
        plot(curves, args.metric, os.path.join(args.out, f"{args.metric}_curve.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
