"""The pixel-scale part of an image-shaped error, for losses that weigh it more than plain squared error does.

FID on MNIST charges as much for noise of std 0.02 or a 3 x 3 blur as for the whole gap between a one-step
student and its teacher's 50-step samples (docs/quality.md, ninth day): it weighs pixel-scale error far above the
rest. The high-pass part is the error minus its 3 x 3 binomial blur, so

    ||e||^2 + hf_weight ||high_pass(e)||^2

is a Sobolev-like norm that charges the pixel-scale part of e (1 + hf_weight) times, and the rest of e as before.
I + hf_weight H^T H is positive definite, so a loss's zero-error fixed point does not move: only which errors its
gradient removes first. MeanFlow and sCM/sCD take it as `hf_weight`.
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


def squared_error(err: torch.Tensor, hf_weight: float | torch.Tensor = 0.0) -> torch.Tensor:
    """||err||^2 + hf_weight ||high_pass(err)||^2 per sample: (B, ...) -> (B,); hf_weight a number or one per
    sample (B,)."""
    sq = err.square().flatten(1).sum(1)
    if not isinstance(hf_weight, torch.Tensor) and not hf_weight:
        return sq
    if err.dim() != 4:
        raise ValueError(
            "objective.hf_weight weighs the pixel-scale part of image-shaped errors, got data of "
            f"shape {tuple(err.shape[1:])}; set objective.hf_weight=0"
        )
    return sq + hf_weight * high_pass(err).square().flatten(1).sum(1)


def first_k_hf_weight(n: int, k: int, hf_weight: float, hf_weight_first: float | None, device) -> float | torch.Tensor:
    """squared_error's hf_weight for a batch of n whose first k samples (an objective's one-step share) take
    hf_weight_first and the others hf_weight; a number when they are alike."""
    if hf_weight_first is None or not k:
        return hf_weight
    w = torch.full((n,), float(hf_weight), device=device)  # a fill on the device: capturable
    w[:k] = hf_weight_first
    return w
