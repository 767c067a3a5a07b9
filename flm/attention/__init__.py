"""Attention backends behind one signature, on the (batch, heads, tokens, head_dim) layout.

    o = attention(q, k, v, backend="triton_jvp")            # plain, forward-AD duals, torch.func.jvp
    o, to = jvp_attention(q, k, v, tq, tk, tv)              # the fused JVP directly
    o = attention(q, k, v, bias=b_BHQK, key_padding_mask=keep_BK)  # additive bias, padded keys

Backends (one module each): math (eager reference), sdpa (PyTorch SDPA), flash (FlashAttention),
triton_jvp (fused Triton JVP forward + FlashAttention backward). Each exposes the same functions:
`attention(q, k, v, *, causal, scale, bias, key_padding_mask)` on plain tensors, `attention_jvp(...)`
on inputs that carry tangents (forward-AD duals, or inside torch.func.jvp; triton_jvp computes (o, to)
in one fused pass, math and sdpa let PyTorch's forward AD run eagerly, flash says it has no
forward-mode rule), and `check_available(device, dtype, head_dim)`, which raises when it cannot run
such inputs. They receive inputs checked here, with the bias as a 4-dim view (or None).

bias is added to the logits q k^T * scale before the softmax and broadcasts from (B or 1, H or 1, Lq,
Lkv); key_padding_mask is bool (B, Lkv) with True = attend to the key (SDPA's attn_mask convention;
nn.MultiheadAttention's key_padding_mask means the opposite). A query row left with no key (every key
masked, or every logit -inf) gets output 0, tangent 0 and zero gradients, not NaN.
"""

import math as _math

import torch

from flm.attention.inputs import as_4d, check_bias_and_mask, check_like, check_qkv, check_tangents, under_functorch, unpack_duals

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


def attention(
    q,
    k,
    v,
    *,
    backend: str = "auto",
    causal: bool = False,
    scale: float | None = None,
    bias=None,
    key_padding_mask=None,
):
    """Softmax attention softmax(q k^T * scale + bias) v; q (B, H, Lq, D), k and v (B, H, Lkv, D).

    Works on plain tensors, forward-mode dual tensors (a dual bias's tangent is the logits' extra
    tangent) and under torch.func.jvp; scale defaults to 1/sqrt(D). bias broadcasts to (B, H, Lq, Lkv);
    key_padding_mask (B, Lkv) bool, True = attend to the key, False = padding.
    """
    (q_, k_, v_, bias_), tangents = unpack_duals(q, k, v, bias)
    check_qkv(q_, k_, v_, causal=causal)
    check_bias_and_mask(bias_, key_padding_mask, q_, k_)
    needs_jvp = tangents is not None or any(under_functorch(x) for x in (q_, k_, v_, bias_) if x is not None)
    module = get_attention(resolve_backend(backend, q_, needs_jvp=needs_jvp))
    module.check_available(q_.device, q_.dtype, q_.shape[-1])
    run = module.attention_jvp if needs_jvp else module.attention
    return run(q, k, v, causal=causal, scale=_default_scale(q_, scale), bias=as_4d(bias), key_padding_mask=key_padding_mask)


def jvp_attention(
    q,
    k,
    v,
    tq,
    tk,
    tv,
    *,
    causal: bool = False,
    scale: float | None = None,
    bias=None,
    bias_tangent=None,
    key_padding_mask=None,
):
    """(o, to): attention and its tangent along (tq, tk, tv) from one fused Triton pass.

    o is differentiable w.r.t. q, k, v and bias (FlashAttention's backward; flm's Triton backward with
    a bias or mask); to is not (consistency losses stop its gradient). bias_tangent (the shape of bias)
    is added to the logits' tangent: d(logits) = scale * (tq k^T + q tk^T) + bias_tangent.
    """
    check_qkv(q, k, v, causal=causal)
    check_tangents((q, k, v), (tq, tk, tv))
    check_bias_and_mask(bias, key_padding_mask, q, k)
    if bias_tangent is not None:
        if bias is None:
            raise ValueError("bias_tangent was given without a bias; pass the bias it is the tangent of as bias=")
        check_like("bias_tangent", bias_tangent, "bias", bias)
    module = get_attention("triton_jvp")
    module.check_available(q.device, q.dtype, q.shape[-1])
    return module.jvp_attention(
        q,
        k,
        v,
        tq,
        tk,
        tv,
        causal=causal,
        scale=_default_scale(q, scale),
        bias=as_4d(bias),
        bias_tangent=as_4d(bias_tangent),
        key_padding_mask=key_padding_mask,
    )


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / _math.sqrt(q.shape[-1]) if scale is None else float(scale)


__all__ = ["BACKENDS", "attention", "get_attention", "jvp_attention", "resolve_backend"]
