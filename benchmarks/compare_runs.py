"""Two training runs' curves compared step by step, as `flm.ablate` compares attention backends: e.g. a run with
`trainer.cuda_graph=true` against the same run eager (issue 16: the graphed MNIST preset under torchrun, with DDP and
with gradient accumulation, matches the eager run's losses within bf16 noise).

    python benchmarks/compare_runs.py RUN RUN_REFERENCE [--metric mse] [--tol 5e-2]

Reads both run folders' metrics.jsonl and prints, over the steps both logged: the relative difference at the first
logged steps (identical runs agree to rounding there), its largest value, and the gap of the mean over the last
quarter with its standard error (flm.ablate.loss_gap: bf16 runs with different kernels drift apart step by step, so
the comparison is of where training got to). Exit code 1 when the gap exceeds --tol and 3 standard errors, as an
ablation flags DRIFT.
"""

import argparse
import sys

from flm.ablate import loss_gap
from flm.log import read_metrics


def curve(records: list[dict], metric: str, run: str) -> dict[int, float]:
    points = {int(r["step"]): float(r[metric]) for r in records if metric in r}
    if not points:
        raise SystemExit(f"error: {run} logged no {metric!r}; metrics it logged: {sorted(records[0]) if records else []}")
    return points


def compare(run: str, ref: str, metric: str | None, tol: float) -> tuple[str, bool]:
    """(the report, whether the runs agree)."""
    records, ref_records = read_metrics(run), read_metrics(ref)
    if not records or not ref_records:
        raise SystemExit(f"error: {run if not records else ref} has an empty metrics.jsonl")
    metric = metric or ("mse" if "mse" in records[0] else "loss")  # MeanFlow's adaptive-weighted loss stays near 1
    a, b = curve(records, metric, run), curve(ref_records, metric, ref)
    steps = sorted(set(a) & set(b))
    if not steps:
        raise SystemExit(f"error: the runs logged {metric!r} at no common step (trainer.log_every differs?)")
    rel = [abs(a[s] - b[s]) / max(abs(b[s]), 1e-30) for s in steps]
    gap, se = loss_gap([a[s] for s in steps], [b[s] for s in steps])
    agree = gap <= tol or gap <= 3 * se
    worst = max(range(len(steps)), key=rel.__getitem__)
    lines = [
        f"{metric} of {run} against {ref}: {len(steps)} common logged steps ({steps[0]}..{steps[-1]})",
        "",
        "| | value |",
        "|---|---|",
        *(f"| relative difference at step {s} | {r:.2e} |" for s, r in list(zip(steps, rel))[:3]),
        f"| largest relative difference (step {steps[worst]}) | {rel[worst]:.2e} |",
        f"| final {metric}, run / reference | {a[steps[-1]]:.5g} / {b[steps[-1]]:.5g} |",
        f"| mean over the last quarter: gap ± standard error | {gap:.2e} ± {se:.1e} |",
        f"| verdict (gap <= {tol:g} or <= 3 standard errors) | {'agree' if agree else 'DRIFT'} |",
    ]
    return "\n".join(lines), agree


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a train.py run folder")
    p.add_argument("reference", help="the run folder to compare against")
    p.add_argument("--metric", default=None, help="a logged metric (default: mse where logged, else loss)")
    p.add_argument("--tol", type=float, default=5e-2, help="relative gap of the last quarter's means (bf16 default)")
    args = p.parse_args(argv)
    try:
        report, agree = compare(args.run, args.reference, args.metric, args.tol)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None
    print(report)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
