"""Does the share of faint pixels rank MNIST runs as FID does? Reads the grids evaluate.py wrote (STEM-steps<k>.png:
the first 100 scored images, labels cycling 0-9) and the FIDs of the evaluation beside each (STEM.json), and
prints per grid: FID, the grid's share of pixels at 8-bit levels 5-15 (flm.metrics.pixels), and the digit FD
where it was measured; then the Pearson and
Spearman correlations with FID over the evaluations whose FID is below --max-fid (runs that make digits), and the
MNIST test digits' own share.

    PYTHONPATH=. python benchmarks/faint_pixels.py --dir docs/quality [--dir MORE] [--max-fid 60]
"""

import argparse
import glob
import json
import os
import re

import numpy as np
import torch
from PIL import Image

from flm.metrics.classifier import mnist_test_digits
from flm.metrics.pixels import FAINT, faint_share

GRID = re.compile(r"(?P<stem>(?P<name>[^-]+).*)-steps(?P<steps>\d+)\.png$")


def grid_images(path: str, size: int = 28, pad: int = 2) -> torch.Tensor:
    """The images of a flm.train.sampling.save_grid PNG as uint8 (N, size, size, 1); empty tiles dropped."""
    grid = np.asarray(Image.open(path).convert("L"))
    rows, cols = ((n - pad) // (size + pad) for n in grid.shape)
    if rows * (size + pad) + pad != grid.shape[0] or cols * (size + pad) + pad != grid.shape[1]:
        raise ValueError(f"{path}: {grid.shape} is not a grid of {size} x {size} images with {pad}-pixel gaps")
    tiles = [
        grid[pad + r * (size + pad) : pad + r * (size + pad) + size, pad + c * (size + pad) : pad + c * (size + pad) + size]
        for r in range(rows)
        for c in range(cols)
    ]
    return torch.from_numpy(np.stack([t for t in tiles if t.any()])[..., None].copy())


def ranks(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x)).astype(float)


def correlations(a, b) -> tuple[float, float]:
    """(Pearson, Spearman) of two equal-length sequences."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.corrcoef(a, b)[0, 1]), float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def rows(folders: list[str]) -> list[dict]:
    """One row per grid STEM-steps<k>.png whose evaluation STEM.json (evaluate.py writes both) holds fid_steps<k>:
    name (the run, STEM up to its first "-"), steps, fid, digit_fd (or None), faint (share of the grid's pixels)."""
    out = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "*-steps*.png"))):
            m = GRID.match(os.path.basename(path))
            report = os.path.join(folder, f"{m.group('stem')}.json") if m else None
            if not (report and os.path.exists(report)):
                continue
            with open(report) as f:
                results, k = json.load(f).get("results") or {}, int(m.group("steps"))
            if f"fid_steps{k}" in results:
                fid, fd = results[f"fid_steps{k}"], results.get(f"digit_fd_steps{k}")
                out.append(
                    {"name": m.group("name"), "steps": k, "fid": fid, "digit_fd": fd, "faint": faint_share(grid_images(path))}
                )
    return sorted(out, key=lambda r: r["fid"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", action="append", required=True, help="a folder of evaluations and grids (repeatable)")
    p.add_argument("--max-fid", type=float, default=60.0, help="correlate only evaluations below this FID")
    args = p.parse_args()
    table = rows(args.dir)
    if not table:
        raise SystemExit(f"error: no grid in {args.dir} has a FID in a quality.json or *-eval.json beside it")
    low, high = FAINT
    print(f"| run | sampler steps | FID | faint pixels ({low}-{high} of 255) | digit FD |\n|---|---|---|---|---|")
    for r in table:
        fd = "-" if r["digit_fd"] is None else f"{r['digit_fd']:.3f}"
        print(f"| {r['name']} | {r['steps']} | {r['fid']:.2f} | {100 * r['faint']:.2f} % | {fd} |")
    kept = [r for r in table if r["fid"] < args.max_fid]
    print(f"\n{len(kept)} of {len(table)} evaluations have FID < {args.max_fid:g}; against FID:")
    if len(kept) >= 3:
        pearson, spearman = correlations([r["fid"] for r in kept], [r["faint"] for r in kept])
        print(f"- faint pixels: Pearson {pearson:.3f}, Spearman {spearman:.3f} ({len(kept)} evaluations)")
    with_fd = [r for r in kept if r["digit_fd"] is not None]
    if len(with_fd) >= 3:
        pearson, spearman = correlations([r["fid"] for r in with_fd], [r["digit_fd"] for r in with_fd])
        print(f"- digit FD: Pearson {pearson:.3f}, Spearman {spearman:.3f} ({len(with_fd)} evaluations)")
        pearson, spearman = correlations([r["fid"] for r in with_fd], [r["faint"] for r in with_fd])
        print(f"- faint pixels on the same evaluations: Pearson {pearson:.3f}, Spearman {spearman:.3f}")
    print(f"- the 10,000 MNIST test digits: {100 * faint_share(mnist_test_digits()):.2f} % faint pixels")


if __name__ == "__main__":
    main()
