"""The two image layouts the metrics accept, brought to one."""

import numpy as np
import torch


def as_float_images(images) -> torch.Tensor:
    """Float (N, C, H, W) in [-1, 1] from either a float tensor/array already in that layout (generator
    outputs) or uint8 (N, H, W, C) (sample.py's .npz, flm.train.sampling.to_uint8)."""
    x = torch.as_tensor(np.asarray(images)) if not isinstance(images, torch.Tensor) else images
    if x.dim() != 4:
        raise ValueError(f"images must be (N, C, H, W) floats in [-1, 1] or uint8 (N, H, W, C), got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        return x.permute(0, 3, 1, 2).float() / 127.5 - 1
    if not x.is_floating_point():
        raise ValueError(f"images must be floats in [-1, 1] or uint8, got {x.dtype}")
    return x


def to_levels(images) -> torch.Tensor:
    """Float 8-bit levels (N, C, H, W) in 0-255 of images in either layout, rounded as a saved sample is: the one
    quantisation that sample.py's files, the grids, FID's input and the faint-pixel share share."""
    return ((as_float_images(images).float() + 1) * 127.5).round().clamp(0, 255)
