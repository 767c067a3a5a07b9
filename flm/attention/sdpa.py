"""torch.nn.functional.scaled_dot_product_attention (PyTorch picks cuDNN, FlashAttention-2, ...).

Its fused kernels have no forward-mode rule, so under a JVP (dual tensors or torch.func.jvp) this
backend runs SDPA's math kernel, which differentiates in both modes.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

from flm.attention.inputs import under_functorch


def attention(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    jvp = under_functorch(q) or any(forward_ad.unpack_dual(x).tangent is not None for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH) if jvp else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def check_available(q: torch.Tensor) -> None:
    """SDPA runs on every device and dtype (it falls back to its math kernel)."""
