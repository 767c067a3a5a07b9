"""torch.nn.functional.scaled_dot_product_attention (PyTorch picks cuDNN, FlashAttention-2, ...).

Its fused kernels have no forward-mode rule, so under a JVP (dual tensors or torch.func.jvp) this
backend runs SDPA's math kernel, which differentiates in both modes.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def attention_jvp(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return attention(q, k, v, causal=causal, scale=scale)


def check_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """SDPA runs on every device and dtype (it falls back to its math kernel)."""
