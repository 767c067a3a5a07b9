"""The share of faint pixels: 8-bit values just above black (5-15 of 255 by default).

On MNIST the digits sit on an exactly black background, and what a few-step sample gets wrong is mostly
faint stray pixels: a halo at the strokes and, in the worse samples, speckle over the background. Over the
H200 runs of docs/quality.md (100 grid images per run, 88 evaluations with FID < 60) this share ranks the runs
as FID does (Spearman 0.94; `benchmarks/faint_pixels.py`), where the digit classifier's Fréchet distance does
not. The cause is the speckle: added to real digits, faint pixels on 2 % of the black background cost 26 FID,
a halo at the strokes with four times as many 3 (`benchmarks/fid_sanity.py --perturb faint`). The 10,000 MNIST
test digits have 0.81 % of their pixels in 5-15.

    from flm.metrics.pixels import faint_share
    faint_share(images)      # images in [-1, 1] (N, C, H, W), or uint8 (N, H, W, C) from sample.py's .npz
"""

import torch

from flm.metrics.images import to_levels

FAINT = (5, 15)  # inclusive 8-bit range: above the rounding noise of black (1-4), below any stroke's edge


def faint_share_per_image(images, faint: tuple[int, int] = FAINT) -> torch.Tensor:
    """(N,) share of each image's pixels whose 8-bit value lies in [faint[0], faint[1]]."""
    low, high = faint
    if not 0 <= low <= high <= 255:
        raise ValueError(f"faint must be 8-bit levels 0 <= low <= high <= 255, got {faint!r}")
    levels = to_levels(images)
    return ((levels >= low) & (levels <= high)).flatten(1).float().mean(1)


def faint_share(images, faint: tuple[int, int] = FAINT) -> float:
    """Share of all pixels of `images` whose 8-bit value lies in [faint[0], faint[1]]."""
    return faint_share_per_image(images, faint).mean().item()
