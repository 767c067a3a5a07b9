"""FlashAttention: the flash_attn package when importable, else PyTorch's built-in FlashAttention-2.

CUDA only, fp16/bf16 only, head dim <= 256; no forward-mode rule (use triton_jvp for JVPs).
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@functools.cache
def flash_attn_func():
    """flash_attn.flash_attn_func, or None when the package is not installed."""
    try:
        from flash_attn import flash_attn_func as fn
    except ImportError:
        return None
    return fn


def attention(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    fn = flash_attn_func()
    if fn is not None:  # flash_attn wants (B, N, H, D)
        o = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal)
        return o.transpose(1, 2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def check_available(q: torch.Tensor) -> None:
    if not q.is_cuda:
        raise ValueError(
            f"attention backend 'flash' needs a CUDA GPU, but the inputs are on {q.device}; "
            "use backend='sdpa' or 'math' on this machine"
        )
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"attention backend 'flash' needs fp16 or bf16 inputs, got {q.dtype}; cast the inputs "
            "(or run under torch.autocast) or use backend='sdpa'"
        )
    if q.shape[-1] > 256 or q.shape[-1] % 8:
        raise ValueError(
            f"attention backend 'flash' needs a head dim that is a multiple of 8 and at most 256, "
            f"got {q.shape[-1]}; use backend='sdpa'"
        )
