"""Does the share of faint pixels rank MNIST runs as FID does? Reads a folder of evaluations (quality.json and
evaluate.py's *-eval.json, which give the FIDs) and the grids evaluate.py wrote beside them (NAME-...-steps<k>.png:
the first 100 scored images, labels cycling 0-9), and prints per (run, sampler steps): FID, the grid's share of
pixels at 8-bit levels 5-15 (flm.metrics.pixels), and the digit FD where it was measured; then the Pearson and
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

from flm.metrics.pixels import FAINT, faint_share

GRID = re.compile(r"(?P<name>.+?)-.*steps(?P<steps>\d+)\.png$")
FID = re.compile(r"fid_steps(\d+)$")


def scores(folder: str) -> dict:
    """{(run name, sampler steps): {"fid": ..., "digit_fd": ...}} from quality.json and *-eval.json in `folder`."""
    found = {}

    def add(name: str, results: dict) -> None:
        for key, value in results.items():
            m = FID.match(key)
            if m:
                k = int(m.group(1))
                found[(name, k)] = {"fid": value, "digit_fd": results.get(f"digit_fd_steps{k}")}

    quality = os.path.join(folder, "quality.json")
    if os.path.exists(quality):
        with open(quality) as f:
            for name, entry in json.load(f).items():
                for report in [*(entry.get("evals") or {}).values(), *([entry["eval"]] if entry.get("eval") else [])]:
                    add(name, report.get("results") or {})
    for path in sorted(glob.glob(os.path.join(folder, "*-eval.json"))):
        with open(path) as f:
            add(os.path.basename(path).split("-")[0], json.load(f).get("results") or {})
    return found


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
    """One row per grid that has a FID: name, steps, fid, digit_fd (or None), faint (share of the grid's pixels)."""
    found, grids = {}, {}
    for folder in folders:
        found.update(scores(folder))
        for path in sorted(glob.glob(os.path.join(folder, "*.png"))):
            m = GRID.match(os.path.basename(path))
            if m:
                grids.setdefault((m.group("name"), int(m.group("steps"))), path)  # the first folder's grid wins
    out = []
    for key, path in grids.items():
        if key in found:
            out.append({"name": key[0], "steps": key[1], **found[key], "faint": faint_share(grid_images(path))})
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
    try:
        from flm.metrics.classifier import mnist_test_digits

        print(f"- the 10,000 MNIST test digits: {100 * faint_share(mnist_test_digits()):.2f} % faint pixels")
    except (OSError, ValueError) as e:  # the shipped test digits are missing from a trimmed install
        print(f"- the MNIST test digits' share not computed: {e}")


if __name__ == "__main__":
    main()
