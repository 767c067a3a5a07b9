"""The pixel-scale part of an image-shaped error, for losses that weigh it more than plain squared error does.

A one-step student's samples fail at pixel scale (speckles, broken strokes) while its 2-step samples fail at
larger scales, at about the same mean squared error (docs/quality.md); FID weighs the first far more. The
high-pass part is the error minus its 3 x 3 binomial blur, so

    ||e||^2 + hf_weight ||high_pass(e)||^2

is a Sobolev-like norm that charges the pixel-scale part of e (1 + hf_weight) times, and the rest of e as before.
"""

import torch


def _blur(e: torch.Tensor, dim: int) -> torch.Tensor:
    """[1 2 1] / 4 along `dim`, the edge values replicated."""
    n = e.shape[dim]
    padded = torch.cat([e.narrow(dim, 0, 1), e, e.narrow(dim, n - 1, 1)], dim)
    return (padded.narrow(dim, 0, n) + 2 * e + padded.narrow(dim, 2, n)) / 4


def high_pass(e: torch.Tensor) -> torch.Tensor:
    """e - blur(e) for e (B, C, H, W), blur the 3 x 3 binomial filter [1 2 1]^T [1 2 1] / 16 per channel with the
    edges replicated (a constant image has no high-pass part). Slices only: no constant tensor made on the host,
    so it runs inside a captured CUDA graph."""
    if e.dim() != 4:
        raise ValueError(f"high_pass takes image-shaped errors (B, C, H, W), got shape {tuple(e.shape)}")
    return e - _blur(_blur(e, 2), 3)
