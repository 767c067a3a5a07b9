"""How far the training velocity is from the exact marginal velocity of the training set, on the linear path.

Flow matching and MeanFlow regress on v = eps - x0, the conditional velocity of one image; the field they should learn
is the marginal velocity v*(x_t, t) = (x_t - E[x0 | x_t]) / t. For a finite training set v* is exact: E[x0 | x_t] is the
posterior mean over all of its images (each a Gaussian likelihood N(x_t; (1 - t) x0_j, t^2 I)). This script draws
training batches as the loop does (labels dropped to the null class at --label-dropout; a class label's posterior is
over that class's images), and prints per time t the mean squared distance per pixel to v* of

- the conditional velocity eps - x0 (`objective.velocity_estimate=sample`, the papers'),
- the batch's estimate (`objective.velocity_estimate=batch`, flm.objectives.posterior.batch_velocity: the posterior over
  the batch's own images),

and the effective number of batch images in that estimate (1 / sum w^2; 1: the sample's own image alone). The last
row averages over MeanFlow's time proposal (logit-normal, --t-mean / --t-std), which is what a step's targets see.

    PYTHONPATH=. python benchmarks/velocity_variance.py --data-root DATA [--dataset mnist] [--batch 256]
"""

import argparse
import math

import torch

from flm.data import build_dataset
from flm.objectives.paths import LinearPath
from flm.objectives.posterior import batch_logits, batch_posterior, batch_velocity


def exact_velocity(path, x0, s, y_in, images, labels, null, chunk: int = 8192):
    """v* at the path sample s of the batch x0 (B, D), over the whole set (images (N, D), float64): the posterior of
    flm.objectives.posterior streamed over the set in chunks (a running log-sum-exp and weighted sum of images)."""
    m = torch.full((len(x0), 1), -math.inf, dtype=torch.float64)
    total = torch.zeros(len(x0), 1, dtype=torch.float64)
    acc = torch.zeros_like(x0)
    for i in range(0, len(images), chunk):
        x = images[i : i + chunk]
        logits = batch_logits(path, x, s, y_in, labels[i : i + chunk], null)
        m_new = torch.maximum(m, logits.max(1, keepdim=True).values)
        scale = torch.exp(m - m_new)
        w = torch.exp(logits - m_new)
        total = total * scale + w.sum(1, keepdim=True)
        acc = acc * scale + w @ x
        m = m_new
    return s.dx_t + path.coefficients(s.t)[2][:, None] * (x0 - acc / total)


def ratio(a: float, b: float) -> float:
    """a / b; 1 where both are 0 (near the data both estimates are v* itself, to the bit)."""
    return a / b if b else (1.0 if a == 0 else math.inf)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-root", default="data")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=2, help="batches per time")
    p.add_argument("--times", default="0.05,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,0.95,0.99")
    p.add_argument("--label-dropout", type=float, default=0.1)
    p.add_argument("--t-mean", type=float, default=-0.4)
    p.add_argument("--t-std", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--references",
        default="",
        help="comma-separated reference-set sizes > --batch: also the estimate over the batch plus that many more training "
        "images (a bank of earlier batches' images would give it)",
    )
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    ds = build_dataset(args.dataset, root=args.data_root, download=False)
    images = (ds.images.double() / 127.5 - 1).flatten(1)
    labels, null = ds.labels, ds.num_classes
    times = [float(t) for t in args.times.split(",")]
    sizes = [int(n) for n in args.references.split(",") if n]
    path = LinearPath()
    print(
        f"{args.dataset} train ({len(images)} images, {images.shape[1]} values), batch {args.batch}, label dropout "
        f"{args.label_dropout}; mean squared distance to the exact marginal velocity v*, per value\n"
    )
    extra = "".join(f" {n} references | ratio |" for n in sizes)
    print(f"| t | eps - x0 | batch estimate | ratio | batch images in the estimate |{extra}")
    print("|---|---|---|---|---|" + "---|---|" * len(sizes))
    rows = []
    for t_value in times:
        cond = est = ess = 0.0
        banked = [0.0] * len(sizes)
        for _ in range(args.batches):
            idx = torch.randint(0, len(images), (args.batch,))
            x, y = images[idx], labels[idx]
            y_in = torch.where(torch.rand(args.batch) < args.label_dropout, torch.full_like(y, null), y)
            t = torch.full((args.batch,), t_value, dtype=torch.float64)
            s = path.sample(x, torch.randn_like(x), t)
            v_star = exact_velocity(path, x, s, y_in, images, labels, null)
            v_batch = batch_velocity(path, x, s, y_in, y, null)
            cond += (s.dx_t - v_star).square().mean().item() / args.batches
            est += (v_batch - v_star).square().mean().item() / args.batches
            ess += (1 / batch_posterior(path, x, s, y_in, y, null).square().sum(1)).mean().item() / args.batches
            for k, n in enumerate(sizes):
                more = torch.randint(0, len(images), (n - args.batch,))
                references = (torch.cat([x, images[more]]), torch.cat([y, labels[more]]), None)  # as a bank gives them
                v_ref = batch_velocity(path, x, s, y_in, y, null, references)
                banked[k] += (v_ref - v_star).square().mean().item() / args.batches
        rows.append((t_value, cond, est, *banked))
        cells = "".join(f" {b:.4f} | {ratio(b, cond):.3f} |" for b in banked)
        print(f"| {t_value:g} | {cond:.4f} | {est:.4f} | {ratio(est, cond):.3f} | {ess:.1f} |{cells}", flush=True)
    # MeanFlow's proposal over the grid (trapezoid in logit space is overkill: weights of the grid's cells)
    ts = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    logit = torch.log(ts / (1 - ts))
    density = torch.exp(-0.5 * ((logit - args.t_mean) / args.t_std) ** 2) / (ts * (1 - ts))
    edges = torch.cat([ts[:1], (ts[1:] + ts[:-1]) / 2, ts[-1:]])
    w = density * (edges[1:] - edges[:-1])
    w = w / w.sum()
    mean = [sum(wi * r[k] for wi, r in zip(w.tolist(), rows)) for k in range(1, len(rows[0]))]
    cells = "".join(f" {b:.4f} | {ratio(b, mean[0]):.3f} |" for b in mean[2:])
    print(
        f"| proposal logit-normal({args.t_mean:g}, {args.t_std:g}) | {mean[0]:.4f} | {mean[1]:.4f} | "
        f"{ratio(mean[1], mean[0]):.3f} | |{cells}"
    )


if __name__ == "__main__":
    main()
