"""torch.nn.functional.scaled_dot_product_attention (PyTorch picks cuDNN, FlashAttention-2, ...).

Its fused kernels have no forward-mode rule, so under a JVP (dual tensors or torch.func.jvp) this
backend runs SDPA's math kernel, which differentiates in both modes. A bias and a key-padding mask
become one float attn_mask (SDPA then picks a kernel that takes one: memory-efficient, cuDNN or math).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> torch.Tensor:
    if bias is None and key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    mask_BHQK = _float_mask(q, k, causal, bias, key_padding_mask)
    # rows with no key left: attend uniformly (finite in every SDPA kernel), then output 0
    empty_BHQ1 = (mask_BHQK == float("-inf")).all(-1, keepdim=True)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BHQK.masked_fill(empty_BHQ1, 0.0), scale=scale)
    return o.masked_fill(empty_BHQ1, 0.0)


def _float_mask(q, k, causal, bias, key_padding_mask) -> torch.Tensor:
    """bias (in q's dtype, as SDPA wants) with -inf at masked keys and above the causal diagonal; the
    shape broadcasts to (B, H, Lq, Lkv). SDPA refuses is_causal together with a mask, so causal goes in here."""
    mask = q.new_zeros(()) if bias is None else bias.to(q.dtype)
    if key_padding_mask is not None:
        mask = mask.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = mask.masked_fill(~keep, float("-inf"))
    return mask


def attention_jvp(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return attention(q, k, v, causal=causal, scale=scale, bias=bias, key_padding_mask=key_padding_mask)


def check_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """SDPA runs on every device and dtype (it falls back to its math kernel)."""
