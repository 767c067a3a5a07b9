"""The pixel-scale part of an image-shaped error, for losses that weigh it more than plain squared error does.

A one-step student's samples fail at pixel scale (speckles, broken strokes) while its 2-step samples fail at
larger scales, at about the same mean squared error (docs/quality.md); FID weighs the first far more. The
high-pass part is the error minus its 3 x 3 binomial blur, so

    ||e||^2 + hf_weight ||high_pass(e)||^2

is a Sobolev-like norm that charges the pixel-scale part of e (1 + hf_weight) times, and the rest of e as before.
"""

import torch
import torch.nn.functional as F


def high_pass(e: torch.Tensor) -> torch.Tensor:
    """e - blur(e) for e (B, C, H, W), blur the 3 x 3 binomial filter [1 2 1]^T [1 2 1] / 16 per channel with the
    edges replicated (a constant image has no high-pass part)."""
    if e.dim() != 4:
        raise ValueError(f"high_pass takes image-shaped errors (B, C, H, W), got shape {tuple(e.shape)}")
    k = torch.tensor([1.0, 2.0, 1.0], dtype=e.dtype, device=e.device)
    k = (k[:, None] * k[None]) / 16
    c = e.shape[1]
    blurred = F.conv2d(F.pad(e, (1, 1, 1, 1), mode="replicate"), k.expand(c, 1, 3, 3), groups=c)
    return e - blurred
