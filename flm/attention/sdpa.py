"""torch.nn.functional.scaled_dot_product_attention (PyTorch picks cuDNN, FlashAttention-2, ...).

Its fused kernels have no forward-mode rule, so under a JVP (dual tensors or torch.func.jvp) this
backend runs SDPA's math kernel, which differentiates in both modes. A bias and a key-padding mask
become one float attn_mask (SDPA then picks a kernel that takes one: memory-efficient, cuDNN or math).
Where SDPA may run cuDNN (CUDA, Hopper on), the plain path hands its backward dO dense in q's stride order
(flm.attention.layout): PyTorch caches cuDNN's backward graphs under q, k, v alone, so without it two consumers of O
that send dO laid out differently at the same shapes (or SDPA's and the fused attention's backward) would share a graph
built for one of them.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flm.attention.layout import grad_in_q_order
from flm.kernels.launch import hopper_or_later


def attention(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> torch.Tensor:
    return _attention(q, k, v, causal, scale, bias, key_padding_mask, grad_in_q_order if cudnn_may_run(q) else _as_is)


def cudnn_may_run(q: torch.Tensor) -> bool:
    """Whether SDPA may pick cuDNN's attention for q: CUDA from Hopper on (its priority there). Elsewhere GradInQOrder's
    Python backward node would cost host time for a cache that is never built."""
    return hopper_or_later(q.device)


def _as_is(o, q):
    return o


def _attention(q, k, v, causal, scale, bias, key_padding_mask, on_output) -> torch.Tensor:
    if bias is None and key_padding_mask is None:
        return on_output(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale), q)
    mask_BHQK = _float_mask(q, k, causal, bias, key_padding_mask)
    # rows with no key left: attend uniformly (finite in every SDPA kernel), then output 0
    empty_BHQ1 = (mask_BHQK == float("-inf")).all(-1, keepdim=True)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BHQK.masked_fill(empty_BHQ1, 0.0), scale=scale)
    o = on_output(o, q)
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
    # the math kernel builds no cuDNN graph, and GradInQOrder has no forward-mode rule
    with sdpa_kernel(SDPBackend.MATH):
        return _attention(q, k, v, causal, scale, bias, key_padding_mask, _as_is)


def check_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """SDPA runs on every device and dtype (it falls back to its math kernel)."""
