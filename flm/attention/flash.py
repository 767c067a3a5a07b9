"""FlashAttention: the flash_attn package when importable, else PyTorch's built-in FlashAttention-2.

CUDA only, fp16/bf16 only, head dims that are multiples of 8 up to 256 (`unsupported`: the rules, also
read by triton_jvp's backward); no forward-mode rule (use triton_jvp for JVPs); no additive bias or
key-padding mask (use sdpa, triton_jvp or math).
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


def attention(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> torch.Tensor:
    if bias is not None or key_padding_mask is not None:
        raise ValueError(
            "attention backend 'flash' takes no bias or key_padding_mask; use backend='sdpa', 'triton_jvp' or 'math' for those"
        )
    fn = flash_attn_func()
    if fn is not None:  # flash_attn wants (B, N, H, D)
        o = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=causal)
        return o.transpose(1, 2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def attention_jvp(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> torch.Tensor:
    raise ValueError(
        "attention backend 'flash' has no forward-mode (JVP) rule; use backend='triton_jvp' "
        "(fused JVP) or 'math' for objectives that take a JVP"
    )


def unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashAttention-2 cannot take such inputs (with the fix), or None when it can."""
    if device.type != "cuda":
        return f"needs a CUDA GPU, but the inputs are on {device}; use backend='sdpa' or 'math' on this machine"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16 or bf16 inputs, got {dtype}; cast the inputs (or run under torch.autocast) or use backend='sdpa'"
    if head_dim > 256 or head_dim % 8:
        return f"needs a head dim that is a multiple of 8 and at most 256, got {head_dim}; use backend='sdpa'"
    return None


def check_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    problem = unsupported(device, dtype, head_dim)
    if problem:
        raise ValueError(f"attention backend 'flash' {problem}")
