"""Eager attention: runs everywhere, differentiable in both modes, the test oracle."""

import torch


def attention(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    # (B, H, Lq, D) x (B, H, Lkv, D) -> (B, H, Lq, Lkv); softmax in fp32 as the fused kernels do
    s_BHQK = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if causal:
        lq, lkv = q.shape[-2], k.shape[-2]
        keep = torch.ones(lq, lkv, dtype=torch.bool, device=q.device).tril()
        s_BHQK = s_BHQK.masked_fill(~keep, float("-inf"))
    p_BHQK = torch.softmax(s_BHQK, dim=-1).to(v.dtype)
    return torch.matmul(p_BHQK, v)


# plain PyTorch ops: forward AD and torch.func.jvp differentiate them as they are
attention_jvp = attention


def check_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """The math backend runs on every device and dtype."""
