"""Eager attention: runs everywhere, differentiable in both modes, the test oracle."""

import torch

from flm.nn import scaled


def attention(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> torch.Tensor:
    # (B, H, Lq, D) x (B, H, Lkv, D) -> (B, H, Lq, Lkv); softmax in fp32 as the fused kernels do
    s_BHQK = scaled(torch.matmul(q, k.transpose(-2, -1)).float(), scale)
    if bias is not None:
        s_BHQK = s_BHQK + bias  # (B or 1, H or 1, Lq or 1, Lkv or 1), added in fp32
    if causal:
        lq, lkv = q.shape[-2], k.shape[-2]
        keep = torch.ones(lq, lkv, dtype=torch.bool, device=q.device).tril()
        s_BHQK = s_BHQK.masked_fill(~keep, float("-inf"))
    if key_padding_mask is not None:  # (B, Lkv), True = attend
        s_BHQK = s_BHQK.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    if bias is None and key_padding_mask is None:
        p_BHQK = torch.softmax(s_BHQK, dim=-1)
    else:
        # a row with no key left (all -inf) attends to nothing: output 0 and finite gradients, where the
        # softmax alone would give NaN (softmax of zeros keeps that row finite before it is zeroed)
        empty_BHQ1 = (s_BHQK == float("-inf")).all(-1, keepdim=True)
        p_BHQK = torch.softmax(s_BHQK.masked_fill(empty_BHQ1, 0.0), dim=-1).masked_fill(empty_BHQ1, 0.0)
    return torch.matmul(p_BHQK.to(v.dtype), v)


# plain PyTorch ops: forward AD and torch.func.jvp differentiate them as they are
attention_jvp = attention


def check_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """The math backend runs on every device and dtype."""
