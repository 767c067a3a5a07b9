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
