"""Fused JVP attention: Triton forward (O, tO, lse in one pass) + FlashAttention's backward.

Three ways in, one set of kernels:
- dual tensors (forward AD): flm.attention unpacks the tangents and calls `jvp_attention`, whose
  autograd.Function returns o (differentiable) and to (no graph) from one fused launch;
- torch.func.jvp: `attention` runs the plain forward, and the Function's `jvp` rule runs the fused
  kernel for the tangent;
- plain tensors: `attention` is a FlashAttention-2 forward (the same kernel without tangents).

The kernels are torch.library custom ops (flm::attention_fwd, flm::attention_jvp_fwd,
flm::attention_bwd, flm::attention_bias_bwd), so torch.compile traces models that call them without
graph breaks. The gradient of o comes from, in order of preference: the flash_attn package, PyTorch's
built-in FlashAttention-2 backward (CUDA, fp16/bf16), flm's own Triton backward (fp32, CPU interpreter).
With an additive bias or a key-padding mask it is always flm's Triton backward (FlashAttention's takes
neither), which also returns the bias's gradient.
"""

import functools
import warnings

import torch
from torch import Tensor
from torch.autograd import forward_ad

from flm.attention.flash import unsupported as fa2_unsupported
from flm.attention.inputs import unpack_duals
from flm.kernels.attention_bwd import attention_bwd as triton_bwd
from flm.kernels.attention_fwd import attention_fwd, check_head_dim, interpreted
from flm.nn import signed

# ---------------------------------------------------------------------------------------------
# Backward implementations: (do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _flash_attn_backward():
    try:
        from flash_attn.flash_attn_interface import _flash_attn_backward as fn
    except ImportError:
        return None
    return fn


def flash_attn_bwd(do, q, k, v, o, lse, causal, scale):
    """flash_attn's backward (layout (B, N, H, D)); flash_attn >= 2.7 signature."""
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    dq, dk, dv = (torch.empty_like(t(x)) for x in (q, k, v))
    _flash_attn_backward()(
        t(do),
        t(q),
        t(k),
        t(v),
        t(o),
        lse.contiguous(),
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def torch_fa2_bwd(do, q, k, v, o, lse, causal, scale):
    """PyTorch's built-in FlashAttention-2 backward, fed with our O and natural-log lse."""
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # unused without dropout
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do,
        q,
        k,
        v,
        o,
        lse.contiguous(),
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )


def _triton_bwd(do, q, k, v, o, lse, causal, scale):
    return triton_bwd(do, q, k, v, o, lse, causal=causal, scale=scale)[:3]


BACKWARDS = {"flash_attn": flash_attn_bwd, "torch_fa2": torch_fa2_bwd, "triton": _triton_bwd}


def backward_impl(q: Tensor) -> str:
    """Which backward runs for inputs like q: 'flash_attn', 'torch_fa2' or 'triton'."""
    if fa2_unsupported(q.device, q.dtype, q.shape[-1]) is None:
        return "flash_attn" if _flash_attn_backward() is not None else "torch_fa2"
    return "triton"


# ---------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile; fake implementations give it shapes)
# ---------------------------------------------------------------------------------------------


def _fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    o, _, lse = attention_fwd(q, k, v, causal=causal, scale=scale, bias=bias, key_padding_mask=key_padding_mask)
    return o, lse


_fwd_op = torch.library.custom_op("flm::attention_fwd", _fwd_impl, mutates_args=())


@_fwd_op.register_fake
def _(q, k, v, causal, scale, bias=None, key_padding_mask=None):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _jvp_fwd_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tq: Tensor,
    tk: Tensor,
    tv: Tensor,
    causal: bool,
    scale: float,
    bias: Tensor | None = None,
    bias_tangent: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    return attention_fwd(
        q, k, v, tq, tk, tv, causal=causal, scale=scale, bias=bias, bias_tangent=bias_tangent, key_padding_mask=key_padding_mask
    )


_jvp_fwd_op = torch.library.custom_op("flm::attention_jvp_fwd", _jvp_fwd_impl, mutates_args=())


@_jvp_fwd_op.register_fake
def _(q, k, v, tq, tk, tv, causal, scale, bias=None, bias_tangent=None, key_padding_mask=None):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _bwd_impl(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    impl = backward_impl(q)
    if impl == "flash_attn":
        try:
            return flash_attn_bwd(do, q, k, v, o, lse, causal, scale)
        except TypeError as e:  # another flash_attn release with another private signature
            _warn_flash_attn_signature(e)
            impl = "torch_fa2"
    dq, dk, dv = BACKWARDS[impl](do, q, k, v, o, lse, causal, scale)
    # custom ops must not return views of their inputs
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


_bwd_op = torch.library.custom_op("flm::attention_bwd", _bwd_impl, mutates_args=())


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _bias_bwd_impl(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    bias: Tensor | None,
    key_padding_mask: Tensor | None,
    bias_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias) by flm's Triton backward; dbias is empty unless bias_grad."""
    dq, dk, dv, dbias = triton_bwd(
        do, q, k, v, o, lse, causal=causal, scale=scale, bias=bias, key_padding_mask=key_padding_mask, bias_grad=bias_grad
    )
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


_bias_bwd_op = torch.library.custom_op("flm::attention_bias_bwd", _bias_bwd_impl, mutates_args=())


@_bias_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale, bias, key_padding_mask, bias_grad):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


@functools.cache
def _warn_flash_attn_signature(err: Exception) -> None:
    warnings.warn(
        f"flash_attn's backward did not accept flm's call ({err}); using PyTorch's FlashAttention-2 backward", stacklevel=2
    )


def _op(op, impl):
    """The custom op while torch.compile traces; its Python body in eager mode (no dispatcher overhead)."""
    return op if torch.compiler.is_compiling() else impl


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


def _zeros_if_none(tangent, like):
    return torch.zeros_like(like) if tangent is None else tangent


def _backward(ctx, do, bias_grad: bool):
    """(dq, dk, dv, dbias) from what setup_context saved, for both Functions: FlashAttention's backward,
    or flm's Triton backward when there is a bias or a key-padding mask; dbias is None unless bias_grad."""
    q, k, v, o, lse, bias, key_padding_mask = ctx.saved_tensors
    do = do.contiguous()
    if bias is None and key_padding_mask is None:
        return *_op(_bwd_op, _bwd_impl)(do, q, k, v, o, lse, ctx.causal, ctx.scale), None
    dq, dk, dv, dbias = _op(_bias_bwd_op, _bias_bwd_impl)(
        do, q, k, v, o, lse, ctx.causal, ctx.scale, bias, key_padding_mask, bias_grad
    )
    return dq, dk, dv, dbias if bias_grad else None


@signed  # _AttentionWithJVP shares its forward, and with it the stored signature
class _Attention(torch.autograd.Function):
    """o = attention(q, k, v, bias, key_padding_mask); backward by FlashAttention (flm's Triton backward
    with a bias or mask)."""

    @staticmethod
    def forward(q, k, v, causal, scale, bias, key_padding_mask):
        return _op(_fwd_op, _fwd_impl)(q, k, v, causal, scale, bias, key_padding_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, causal, scale, bias, key_padding_mask = inputs
        o, lse = output
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, o, lse, bias, key_padding_mask)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, do, _dlse):
        dq, dk, dv, dbias = _backward(ctx, do, bias_grad=ctx.needs_input_grad[5])
        return dq, dk, dv, None, None, dbias, None


class _AttentionWithJVP(_Attention):
    """_Attention plus a forward-mode rule (the fused kernel) for torch.func.jvp and dual tensors.

    Dynamo cannot trace Functions that define `jvp`, so compiled code uses _Attention.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        _Attention.setup_context(ctx, inputs, output)
        q, k, v, _, _, bias, key_padding_mask = inputs
        ctx.save_for_forward(q, k, v, bias, key_padding_mask)

    @staticmethod
    def jvp(ctx, tq, tk, tv, _tcausal, _tscale, tbias, _tmask):
        q, k, v, bias, key_padding_mask = ctx.saved_tensors
        tq, tk, tv = (_zeros_if_none(t, x) for t, x in zip((tq, tk, tv), (q, k, v)))
        with torch.no_grad():
            _, to, _ = _op(_jvp_fwd_op, _jvp_fwd_impl)(q, k, v, tq, tk, tv, ctx.causal, ctx.scale, bias, tbias, key_padding_mask)
        return to, None


@signed
class _JVPAttention(torch.autograd.Function):
    """(o, to) from one fused launch; o differentiable (FlashAttention backward, or flm's Triton
    backward with a bias or mask), to not."""

    @staticmethod
    def forward(q, k, v, tq, tk, tv, causal, scale, bias, bias_tangent, key_padding_mask):
        return _op(_jvp_fwd_op, _jvp_fwd_impl)(q, k, v, tq, tk, tv, causal, scale, bias, bias_tangent, key_padding_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, _, _, _, causal, scale, bias, _, key_padding_mask = inputs
        o, to, lse = output
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, o, lse, bias, key_padding_mask)
        ctx.mark_non_differentiable(to, lse)

    @staticmethod
    def backward(ctx, do, _dto, _dlse):
        dq, dk, dv, dbias = _backward(ctx, do, bias_grad=ctx.needs_input_grad[8])
        return dq, dk, dv, None, None, None, None, None, dbias, None, None


# ---------------------------------------------------------------------------------------------
# Backend interface (inputs already checked by flm.attention)
# ---------------------------------------------------------------------------------------------


def _expand_to_logits(bias, q, k):
    """The bias with its query and key dims expanded (a view): the kernels broadcast it over batch and
    heads, and autograd sums its gradient over the expanded dims."""
    return None if bias is None else bias.expand(bias.shape[0], bias.shape[1], q.shape[2], k.shape[2])


def attention(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> Tensor:
    fn = _Attention if torch.compiler.is_compiling() else _AttentionWithJVP
    return fn.apply(q, k, v, causal, scale, _expand_to_logits(bias, q, k), key_padding_mask)[0]


def jvp_attention(
    q, k, v, tq, tk, tv, *, causal: bool, scale: float, bias=None, bias_tangent=None, key_padding_mask=None
) -> tuple[Tensor, Tensor]:
    # tangents never need a gradient: detaching keeps any graph they carry out of this op
    tbias = None if bias_tangent is None else _expand_to_logits(bias_tangent.detach(), q, k)
    o, to, _ = _JVPAttention.apply(
        q,
        k,
        v,
        tq.detach(),
        tk.detach(),
        tv.detach(),
        causal,
        scale,
        _expand_to_logits(bias, q, k),
        tbias,
        key_padding_mask,
    )
    return o, to


def attention_jvp(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> Tensor:
    """Inputs with tangents: dual tensors take the fused launch; under torch.func.jvp the tangents are
    not visible here, and the Function's jvp rule runs the fused kernel."""
    (q_, k_, v_, bias_), tangents = unpack_duals(q, k, v, bias)
    if tangents is None:
        return attention(q, k, v, causal=causal, scale=scale, bias=bias, key_padding_mask=key_padding_mask)
    *tqkv, tbias = tangents
    o, to = jvp_attention(
        q_, k_, v_, *tqkv, causal=causal, scale=scale, bias=bias_, bias_tangent=tbias, key_padding_mask=key_padding_mask
    )
    return forward_ad.make_dual(o, to)


def check_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"attention backend 'triton_jvp' takes fp16, bf16 or fp32 inputs, got {dtype}; cast the inputs or use backend='math'"
        )
    if device.type != "cuda" and not interpreted():
        raise ValueError(
            f"attention backend 'triton_jvp' needs a CUDA GPU, but the inputs are on {device}; "
            "use backend='math' here (or set TRITON_INTERPRET=1 to run the kernels in Triton's "
            "CPU interpreter, slowly, for tests)"
        )
    check_head_dim(head_dim)
