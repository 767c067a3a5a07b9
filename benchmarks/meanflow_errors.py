"""Where a MeanFlow run's loss goes: its error against the target, the adaptive weight and the gradient each
sample gets, binned by the interval t - r, on the run's own training data.

MeanFlow's loss is sg(w) ||u - u_tgt||^2 with w = 1 / (||u - u_tgt||^2 + c)^p, so a sample's gradient in u has
norm 2 w ||u - u_tgt||: at p = 1 it shrinks as 1 / ||u - u_tgt|| once the error exceeds sqrt(c). The table says
which intervals the training signal goes to (the 1-step sampler is the interval [0, 1]).

    PYTHONPATH=. python benchmarks/meanflow_errors.py --ckpt RUN --data-root data            # teacher from the run
    PYTHONPATH=. python benchmarks/meanflow_errors.py --ckpt RUN --teacher FM_RUN --weights ema --batches 16

The times, noise and labels are drawn as in training (the objective's own sampler of t and r); `--seed` fixes them.
`--bf16-gap` computes each batch again under bf16 autocast, from the same draws, and adds the per-element mean
square of the difference of the two errors by interval: how much of a bin's error the precision of training could
account for (the target's JVP included).
"""

import argparse
import contextlib
import dataclasses

import torch

from flm.data import stored_data
from flm.objectives import MeanFlow
from flm.objectives.teacher import load_teacher
from flm.train.generator import load_generator, open_generator

EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="a MeanFlow run folder or checkpoint (meanflow, meanflow_distill, meanflow_dmd)")
    p.add_argument("--teacher", default=None, help="the flow-matching teacher of a distilled run (default: the run's)")
    p.add_argument("--weights", default="raw", choices=["raw", "ema"], help="raw: the weights the loss trains")
    p.add_argument("--data-root", default=None, help="the dataset folder (default: the run's data.root)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-gap", action="store_true", help="also the error's change under bf16 autocast, by interval")
    return p.parse_args(argv)


def interval_table(t, r, err, objective: MeanFlow, edges=EDGES, bf16_gap=None) -> list[dict]:
    """One row per bin of t - r: samples, per-element error, mean weight, mean loss and each bin's share of
    the summed per-sample gradient norms 2 w ||u - u_tgt||; with `bf16_gap` (the error's change under bf16,
    per sample) its per-element mean square too."""
    sq = err.square().flatten(1).sum(1)
    w = objective.adaptive_weight(sq)
    grad = 2 * w * sq.sqrt()
    gap, total = t - r, grad.sum()
    rows = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        last = i == len(edges) - 2
        inside = (gap >= lo) & ((gap <= hi) if last else (gap < hi))
        rows.append(
            {
                "interval": f"[{lo:g}, {hi:g}{']' if last else ')'}",
                "n": int(inside.sum()),
                "mse": float(sq[inside].mean()) / err[0].numel(),  # an empty bin's means are nan
                "weight": float(w[inside].mean()),
                "loss": float((w * sq)[inside].mean()),
                "grad_share": float(grad[inside].sum() / total),
            }
        )
        if bf16_gap is not None:
            rows[-1]["bf16_gap"] = float(bf16_gap[inside].square().mean())
    return rows


def markdown(rows: list[dict]) -> str:
    gap = "bf16_gap" in rows[0]
    lines = [
        "| t - r | samples | error per element | mean weight | mean loss | share of gradient |"
        + (" bf16 - fp32 error, per element |" if gap else ""),
        "|---|---|---|---|---|---|" + ("---|" if gap else ""),
    ]
    for row in rows:
        lines.append(
            f"| {row['interval']} | {row['n']} | {row['mse']:.4g} | {row['weight']:.4g} | {row['loss']:.4g} | "
            f"{100 * row['grad_share']:.1f} % |" + (f" {row['bf16_gap']:.3g} |" if gap else "")
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    bundle, path = open_generator(args.ckpt)
    model, objective = load_generator(bundle, weights=args.weights, device=device, source=path)
    if not isinstance(objective, MeanFlow):
        raise SystemExit(f"error: {path} is a {type(objective).__name__} run; this breaks down MeanFlow's loss only")
    teacher_path = args.teacher or getattr(objective, "teacher", None)
    teacher = None
    if teacher_path:
        teacher = load_teacher(teacher_path, {**bundle["model_args"], "attention": "auto"}).to(device).eval()
    data = stored_data((bundle.get("config") or {}).get("data"), args.data_root)
    dataset = dataclasses.replace(data, download=False).build()
    torch.manual_seed(args.seed)
    parts, gaps = [], []
    with torch.no_grad():  # forward-mode AD works without the graph of reverse mode
        for _ in range(args.batches):
            items = [dataset[i] for i in torch.randint(len(dataset), (args.batch_size,)).tolist()]
            x = torch.stack([image for image, _ in items]).to(device)
            y = torch.tensor([label for _, label in items], device=device) if dataset.num_classes else None
            # with --bf16-gap the fp32 pass leaves the random state as it found it, so that the bf16 pass draws the
            # same times, noise and label dropout
            cuda = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda) if args.bf16_gap else contextlib.nullcontext():
                parts.append(objective.errors(model, x, y, teacher=teacher))
            if args.bf16_gap:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    gaps.append(objective.errors(model, x, y, teacher=teacher)[2] - parts[-1][2])
    t, r, err = (torch.cat(p) for p in zip(*parts))
    print(f"{path} ({args.weights} weights), {len(t)} samples; adaptive_p {objective.adaptive_p}, c {objective.adaptive_c}")
    print(markdown(interval_table(t, r, err, objective, bf16_gap=torch.cat(gaps) if gaps else None)))


if __name__ == "__main__":
    main()
