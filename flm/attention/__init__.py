"""Attention backends behind one signature, on the (batch, heads, tokens, head_dim) layout.

    o = attention(q, k, v, backend="triton_jvp")            # plain, forward-AD duals, torch.func.jvp
    o, to = jvp_attention(q, k, v, tq, tk, tv)              # the fused JVP directly

Backends (one module each): math (eager reference), sdpa (PyTorch SDPA), flash (FlashAttention),
triton_jvp (fused Triton JVP forward + FlashAttention backward). Each exposes the same functions:
`attention(q, k, v, *, causal, scale)` on plain tensors, `attention_jvp(...)` on inputs that carry
tangents (forward-AD duals, or inside torch.func.jvp; triton_jvp computes (o, to) in one fused pass,
math and sdpa let PyTorch's forward AD run eagerly, flash says it has no forward-mode rule), and
`check_available(device, dtype, head_dim)`, which raises when it cannot run such inputs.
"""

import math as _math

import torch

from flm.attention.inputs import check_qkv, check_tangents, under_functorch, unpack_duals

from flm.attention import flash, math, sdpa, triton_jvp

_MODULES = {"math": math, "sdpa": sdpa, "flash": flash, "triton_jvp": triton_jvp}
BACKENDS = tuple(_MODULES)


def get_attention(name: str):
    """The backend module `name` (attention, attention_jvp, check_available)."""
    if name not in _MODULES:
        raise ValueError(f"unknown attention backend {name!r}; valid names: {', '.join(('auto',) + BACKENDS)}")
    return _MODULES[name]


def resolve_backend(name: str, q: torch.Tensor, *, needs_jvp: bool) -> str:
    """'auto' -> the fastest backend that runs here for this call; other names pass through."""
    if name != "auto":
        get_attention(name)  # validates the name
        return name
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # fused JVP when a tangent is (or may be) present; PyTorch's fused kernels otherwise
        return "triton_jvp" if needs_jvp else "sdpa"
    return "math" if needs_jvp else "sdpa"


def attention(q, k, v, *, backend: str = "auto", causal: bool = False, scale: float | None = None):
    """Softmax attention softmax(q k^T * scale) v; q (B, H, Lq, D), k and v (B, H, Lkv, D).

    Works on plain tensors, forward-mode dual tensors and under torch.func.jvp; scale defaults
    to 1/sqrt(D).
    """
    (q_, k_, v_), tangents = unpack_duals(q, k, v)
    check_qkv(q_, k_, v_, causal=causal)
    needs_jvp = tangents is not None or under_functorch(q_)
    module = get_attention(resolve_backend(backend, q_, needs_jvp=needs_jvp))
    module.check_available(q_.device, q_.dtype, q_.shape[-1])
    run = module.attention_jvp if needs_jvp else module.attention
    return run(q, k, v, causal=causal, scale=_default_scale(q_, scale))


def jvp_attention(q, k, v, tq, tk, tv, *, causal: bool = False, scale: float | None = None):
    """(o, to): attention and its tangent along (tq, tk, tv) from one fused Triton pass.

    o is differentiable w.r.t. q, k, v (FlashAttention's backward); to is not (consistency losses
    stop its gradient).
    """
    check_qkv(q, k, v, causal=causal)
    check_tangents((q, k, v), (tq, tk, tv))
    module = get_attention("triton_jvp")
    module.check_available(q.device, q.dtype, q.shape[-1])
    return module.jvp_attention(q, k, v, tq, tk, tv, causal=causal, scale=_default_scale(q, scale))


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / _math.sqrt(q.shape[-1]) if scale is None else float(scale)


__all__ = ["BACKENDS", "attention", "get_attention", "jvp_attention", "resolve_backend"]
