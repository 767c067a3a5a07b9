"""Sampling shared by the training loop's grids and sample.py: one seed per image, PNG grids, .npz."""

import contextlib
import math

import numpy as np
import torch

from flm.files import write_atomically
from flm.metrics.images import to_levels
from flm.objectives.paths import randn_per_image


def class_labels(n: int, num_classes: int, label: int | None = None) -> torch.Tensor | None:
    """Labels for n images: all `label` if given, else cycling 0, 1, ..., num_classes - 1 (None if unconditional)."""
    if num_classes == 0:
        if label is not None:
            raise ValueError(f"label={label} given but the model is unconditional; drop the label option")
        return None
    if label is not None and not 0 <= label < num_classes:
        raise ValueError(f"label must be in [0, {num_classes - 1}], got {label}")
    return torch.full((n,), label) if label is not None else torch.arange(n) % num_classes


@torch.no_grad()
def generate(
    model,
    objective,
    *,
    seeds,
    labels,
    shape,
    steps: int,
    cfg_scale: float = 1.0,
    batch_size: int = 64,
    device="cpu",
    amp_dtype: torch.dtype | None = None,
    decode=None,
) -> torch.Tensor:
    """Images in [-1, 1], (len(seeds), *shape), on the CPU; with `decode` (a latent run's flm.latents.Decoder),
    the sampled latents of `shape` decoded to images.

    Image i has its own generator seeded with seeds[i]: it draws the starting noise, and the sampler
    draws any later noise (multi-step sCM's re-noising) from it too, so image i depends only on
    seeds[i] and labels[i], whatever the batch size.
    """
    was_training = model.training
    model.eval()
    out = []
    for lo in range(0, len(seeds), batch_size):
        seeds_b = seeds[lo : lo + batch_size]
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds_b]
        noise = randn_per_image(generators, shape, device=device)
        y = None if labels is None else labels[lo : lo + batch_size].to(device)
        autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with autocast:
            x = objective.sample(model, noise, y, steps=steps, cfg_scale=cfg_scale, generators=generators)
        out.append((x.float() if decode is None else decode(x)).clamp(-1, 1).cpu())
    model.train(was_training)
    return torch.cat(out)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[-1, 1] (N, C, H, W) float -> uint8 (N, H, W, C)."""
    return to_levels(images).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def save_grid(images: torch.Tensor, path: str, nrow: int | None = None) -> None:
    """PNG grid of [-1, 1] images, written atomically (temporary file, then rename)."""
    from PIL import Image

    n, c, h, w = images.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    ncol = math.ceil(n / nrow)
    pixels = to_uint8(images)
    pad = 2
    grid = np.zeros((ncol * (h + pad) + pad, nrow * (w + pad) + pad, c), dtype=np.uint8)
    for i in range(n):
        r, q = divmod(i, nrow)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + q * (w + pad) : pad + q * (w + pad) + w] = pixels[i]
    image = Image.fromarray(grid[..., 0] if c == 1 else grid)
    write_atomically(path, lambda tmp: image.save(tmp, format="PNG"), needed_bytes=grid.nbytes // 4)


def save_npz(path: str, images: torch.Tensor, seeds, labels) -> None:
    """images (uint8 N, H, W, C), seeds and labels (-1 when unconditional), written atomically."""
    labels = np.full(len(seeds), -1) if labels is None else labels.numpy()
    pixels = to_uint8(images)
    write_atomically(
        path,
        lambda tmp: np.savez(tmp, images=pixels, seeds=np.asarray(seeds), labels=labels),
        needed_bytes=pixels.nbytes,
        tmp_suffix=".tmp.npz",
    )  # np.savez adds .npz to other names
