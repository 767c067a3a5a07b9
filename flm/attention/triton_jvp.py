"""Fused JVP attention: Triton forward (O, tO, lse in one pass) + a fused backward (cuDNN's, FlashAttention's).

Three ways in, one set of kernels:
- dual tensors (forward AD): flm.attention unpacks the tangents and calls `jvp_attention`, whose
  autograd.Function returns o (differentiable) and to (no graph) from one fused launch;
- torch.func.jvp: `attention` runs the plain forward, and the Function's `jvp` rule runs the fused
  kernel for the tangent;
- plain tensors: `attention` is a FlashAttention-2 forward (the same kernel without tangents).

The kernels are torch.library custom ops (flm::attention_fwd, flm::attention_jvp_fwd,
flm::attention_bwd, flm::attention_bias_bwd), so torch.compile traces models that call them without
graph breaks. The gradient of o comes from, in order of preference (`backward_impl`): PyTorch's cuDNN
attention backward on Hopper (compute capability 9.x, fp16/bf16, head dims up to 128; once per device,
dtype and head dim a self-check on a tiny input must pass first), the flash_attn package, PyTorch's
built-in FlashAttention-2 backward (CUDA, fp16/bf16), flm's own Triton backward (fp32, CPU interpreter).
$FLM_ATTN_BACKWARD (auto, flash_attn, torch_fa2, cudnn, triton) forces one. With an additive bias or a
key-padding mask it is always flm's Triton backward (the others take neither), which also returns the
bias's gradient. FLM_ATTENTION_NATIVE_NODE=1 records aten's C++ cuDNN node around the fused forward's output in place
of this module's Functions (flm.attention.native).
"""

import functools
import os
import warnings

import torch
from torch import Tensor
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _get_current_dispatch_mode

from flm.attention import native
from flm.attention.flash import unsupported as fa2_unsupported
from flm.attention.inputs import unpack_duals
from flm.attention.layout import in_q_order, q_order
from flm.kernels.attention_bwd import attention_bwd as triton_bwd
from flm.kernels.attention_fwd import attention_fwd, check_head_dim, interpreted
from flm.kernels.launch import traced, tracing
from flm.nn import apply, signed

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


def torch_cudnn_bwd(do, q, k, v, o, lse, causal, scale):
    """PyTorch's cuDNN attention backward, fed with our O and natural-log lse as the (B, H, Lq, 1) fp32
    statistics that cuDNN's forward returns. It takes q, k, v with any strides of unit head-dim stride, but O and dO
    only dense in q's order, as SDPA's own forward lays O out and flm's sdpa backend hands its dO over: PyTorch caches
    each backward graph under q, k and v alone (flm.attention.layout)."""
    o, do = in_q_order(o, q), in_q_order(do, q)
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed and offset: no dropout
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do,
        q,
        k,
        v,
        o,
        lse.unsqueeze(-1),
        unused,
        unused,
        None,  # attn_bias
        None,  # cum_seq_q, cum_seq_k: not a nested tensor
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        scale=scale,
    )


def _triton_bwd(do, q, k, v, o, lse, causal, scale):
    return triton_bwd(do, q, k, v, o, lse, causal=causal, scale=scale)[:3]


BACKWARDS = {"flash_attn": flash_attn_bwd, "torch_fa2": torch_fa2_bwd, "cudnn": torch_cudnn_bwd, "triton": _triton_bwd}
BACKWARD_ENV = "FLM_ATTN_BACKWARD"


@functools.cache
def _cudnn_op_available() -> bool:
    return torch.backends.cudnn.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")


def cudnn_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why cuDNN's attention backward cannot take such inputs, or None when it can."""
    if device.type != "cuda":
        return f"needs a CUDA GPU, but the inputs are on {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16 or bf16 inputs, got {dtype}"
    if head_dim > 128 or head_dim % 8:
        return f"needs a head dim that is a multiple of 8 and at most 128, got {head_dim}"
    if not _cudnn_op_available():
        return "needs a PyTorch built with cuDNN (torch.backends.cudnn.is_available() is False, or no cuDNN attention op)"
    return None


@functools.cache
def _cudnn_by_default(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """cuDNN's backward is the default on Hopper only (the GPU it was chosen on); elsewhere it must be forced."""
    return cudnn_unsupported(device, dtype, head_dim) is None and torch.cuda.get_device_capability(device)[0] == 9


def _reference_grads(do, q, k, v, causal, scale):
    """(dq, dk, dv) of softmax(q k^T * scale) v in fp32, written out (no autograd: this runs inside backward
    passes and custom ops), and the natural-log lse (B, H, Lq)."""
    do, q, k, v = (x.float() for x in (do, q, k, v))
    s_BHQK = q @ k.transpose(-2, -1) * scale
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        s_BHQK = s_BHQK.masked_fill(~keep, float("-inf"))
    lse_BHQ = s_BHQK.logsumexp(-1)
    p_BHQK = (s_BHQK - lse_BHQ[..., None]).exp()
    o = p_BHQK @ v
    dp_BHQK = do @ v.transpose(-2, -1)
    ds_BHQK = p_BHQK * (dp_BHQK - (do * o).sum(-1, keepdim=True))
    return (ds_BHQK @ k * scale, ds_BHQK.transpose(-2, -1) @ q * scale, p_BHQK.transpose(-2, -1) @ do), o, lse_BHQ


def _cudnn_self_check(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when cuDNN's backward, fed as flm's forward feeds it (O and the natural-log lse), matches the
    fp32 reference on a tiny input with and without the causal mask; else what went wrong. A wrong
    statistics format (log2, another layout) gives errors of order 1, bf16 rounding about 1e-2."""
    g = torch.Generator(device=device).manual_seed(0)
    do, q, k, v = (torch.randn(1, 2, 80, head_dim, device=device, generator=g).to(dtype) for _ in range(4))
    scale = head_dim**-0.5
    for causal in (False, True):
        ref, o, lse = _reference_grads(do, q, k, v, causal, scale)
        try:
            got = BACKWARDS["cudnn"](do, q, k, v, o.to(dtype), lse, causal, scale)
        except RuntimeError as err:
            return _raised(err)
        errs = [((x.float() - r).norm() / r.norm()).item() for x, r in zip(got, ref)]
        if not max(errs) < 0.05:  # NaN fails too
            errs = ", ".join(f"{e:.2g}" for e in errs)
            return f"gave (dq, dk, dv) that differ from the fp32 reference by {errs} (relative, causal={causal})"
    return None


# (device, dtype, head_dim) -> None once cuDNN's backward passed its self-check, else why it is not used
_CUDNN_VERDICTS: dict[tuple, str | None] = {}


def _cudnn_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    key = (_device_key(device), dtype, head_dim)
    if key not in _CUDNN_VERDICTS:
        if torch.cuda.is_current_stream_capturing():  # the check allocates and synchronises: not now
            return "cannot run its self-check inside a CUDA graph capture; run one step eagerly first"
        if _get_current_dispatch_mode() is not None:  # torch.compile traces the backward with fake tensors
            return "cannot run its self-check while torch.compile traces the step; check_available settles it first"
        _CUDNN_VERDICTS[key] = _cudnn_self_check(device, dtype, head_dim)
        if _CUDNN_VERDICTS[key] is not None:
            _warn_cudnn(key, _CUDNN_VERDICTS[key])
    return _CUDNN_VERDICTS[key]


@functools.cache
def _settle_cudnn(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """cuDNN's self-check, once per shape, eagerly (check_available): a compiled step's backward is traced with fake
    tensors and cannot run it."""
    if _cudnn_by_default(device, dtype, head_dim):
        _cudnn_problem(device, dtype, head_dim)


def _device_key(device: torch.device) -> torch.device:
    """cuda and cuda:<current> are one GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _raised(err: Exception) -> str:
    return f"raised {str(err).splitlines()[0][:200]}"


def _warn_cudnn(key, problem: str) -> None:
    device, dtype, head_dim = key
    warnings.warn(
        f"cuDNN's attention backward is not used for {dtype}, head dim {head_dim} on {device}: it {problem}; "
        f"using FlashAttention-2's backward instead (set {BACKWARD_ENV} to choose one)",
        stacklevel=3,
    )


@functools.cache
def _forced(value: str) -> str | None:
    """The backward named by $FLM_ATTN_BACKWARD (read on every call, so tests and scripts may set it late),
    or None for auto (or unset)."""
    if value in ("", "auto"):
        return None
    if value not in BACKWARDS:
        raise ValueError(f"{BACKWARD_ENV}={value!r} names no attention backward; valid values: auto, {', '.join(BACKWARDS)}")
    return value


def _forced_problem(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if name == "cudnn":
        return cudnn_unsupported(device, dtype, head_dim) or _cudnn_problem(device, dtype, head_dim)
    if name in ("flash_attn", "torch_fa2"):
        problem = fa2_unsupported(device, dtype, head_dim)
        if problem is None and name == "flash_attn" and _flash_attn_backward() is None:
            problem = "needs the flash_attn package (pip install flm[flash])"
        return problem
    return None  # flm's Triton backward takes whatever the Triton forward took


def backward_impl(q: Tensor) -> str:
    """Which backward runs for inputs like q (no bias, no mask): 'cudnn', 'flash_attn', 'torch_fa2' or 'triton'."""
    device, dtype, head_dim = q.device, q.dtype, q.shape[-1]
    forced = _forced(os.environ.get(BACKWARD_ENV, "auto"))
    if forced is not None:
        problem = _forced_problem(forced, device, dtype, head_dim)
        if problem is not None:
            raise ValueError(
                f"{BACKWARD_ENV}={forced} cannot take {dtype} inputs with head dim {head_dim} on {device}: the {forced} "
                f"backward {problem}; unset {BACKWARD_ENV} (or set it to auto) to let flm choose"
            )
        return forced
    key = (device, dtype, head_dim)
    impl = _AUTO_IMPLS.get(key)
    if impl is None:
        impl = _auto_impl(device, dtype, head_dim)
        if not _cudnn_by_default(device, dtype, head_dim) or (_device_key(device), dtype, head_dim) in _CUDNN_VERDICTS:
            _AUTO_IMPLS[key] = impl  # settled: cuDNN's verdict will not change (a refusal clears this)
    return impl


# (device, dtype, head_dim) -> the backward that auto chose: looked up once per shape, not on every backward
_AUTO_IMPLS: dict[tuple, str] = {}


def _auto_impl(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    if fa2_unsupported(device, dtype, head_dim) is not None:
        return "triton"
    if _cudnn_by_default(device, dtype, head_dim) and _cudnn_problem(device, dtype, head_dim) is None:
        return "cudnn"
    return "flash_attn" if _flash_attn_backward() is not None else "torch_fa2"


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
    o, _, lse = attention_fwd(
        q, k, v, causal=causal, scale=scale, bias=bias, key_padding_mask=key_padding_mask, out_order=q_order(q)
    )
    return o, lse


def _contiguous_outputs(fn):
    """A custom op's body: fn with contiguous outputs, the layout the op's fake implementation gives torch.compile
    (above head dim 128 the kernel writes padded rows, which eager mode keeps as views without the padding)."""

    @functools.wraps(fn)  # the op's schema comes from fn's signature
    def body(*args, **kwargs):
        return tuple(x.contiguous() for x in fn(*args, **kwargs))

    return body


_fwd_op = torch.library.custom_op("flm::attention_fwd", _contiguous_outputs(_fwd_impl), mutates_args=())


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
        q,
        k,
        v,
        tq,
        tk,
        tv,
        causal=causal,
        scale=scale,
        bias=bias,
        bias_tangent=bias_tangent,
        key_padding_mask=key_padding_mask,
        out_order=q_order(q),
    )


_jvp_fwd_op = torch.library.custom_op("flm::attention_jvp_fwd", _contiguous_outputs(_jvp_fwd_impl), mutates_args=())


@_jvp_fwd_op.register_fake
def _(q, k, v, tq, tk, tv, causal, scale, bias=None, bias_tangent=None, key_padding_mask=None):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _bwd_impl(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    impl = backward_impl(q)
    if impl == "cudnn" and _forced(os.environ.get(BACKWARD_ENV, "auto")) is None:
        try:
            return _like_inputs(BACKWARDS["cudnn"](do, q, k, v, o, lse, causal, scale), q, k, v)
        except RuntimeError as err:  # passed the self-check, refused these shapes: not again for such inputs
            key = (q.device, q.dtype, q.shape[-1])
            _CUDNN_VERDICTS[key] = _raised(err)
            _AUTO_IMPLS.clear()
            _warn_cudnn(key, _CUDNN_VERDICTS[key])
            impl = backward_impl(q)
    do = do.contiguous()  # cuDNN's takes dO as it comes (in q's order from the DiT's projection); the others dense
    if impl == "flash_attn":
        try:
            return _like_inputs(flash_attn_bwd(do, q, k, v, o, lse, causal, scale), q, k, v)
        except TypeError as e:  # another flash_attn release with another private signature
            _warn_flash_attn_signature(e)
            impl = "torch_fa2"
    return _like_inputs(BACKWARDS[impl](do, q, k, v, o, lse, causal, scale), q, k, v)


def _like_inputs(grads, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) dense in q's, k's and v's stride order (`in_q_order`), as cuDNN's backward allocates them and the
    backward op's fake implementation promises: for the DiT's (B, H, L, D) views of one projection, (B, L, H, D)
    storage, which reaches the projection's gradient without the copies to and from contiguous that aten's own node
    does not make (a graphed DiT-B/2 step, H100, fifty-seventh day: docs/train_step.md, Run Q). A copy only where a
    backward returns another layout."""
    return tuple(in_q_order(g, x) for g, x in zip(grads, (q, k, v)))


_bwd_op = torch.library.custom_op("flm::attention_bwd", _bwd_impl, mutates_args=())


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale):
    return _like_inputs((q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)), q, k, v)


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
    return op if torch.compiler.is_compiling() or tracing() else impl


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------


def _zeros_if_none(tangent, like):
    return torch.zeros_like(like) if tangent is None else tangent


def _backward(ctx, do, bias_grad: bool):
    """(dq, dk, dv, dbias) from what setup_context saved, for both Functions: FlashAttention's backward,
    or flm's Triton backward when there is a bias or a key-padding mask; dbias is None unless bias_grad."""
    q, k, v, o, lse, bias, key_padding_mask = ctx.saved_tensors
    if do is None:  # gradients are not materialised: o took none
        return None, None, None, None
    if bias is None and key_padding_mask is None:
        return *_op(_bwd_op, _bwd_impl)(do, q, k, v, o, lse, ctx.causal, ctx.scale), None
    do = do.contiguous()
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
        ctx.set_materialize_grads(False)  # lse takes no gradient: no zeros to allocate and fill

    @staticmethod
    def backward(ctx, do, _dlse):
        dq, dk, dv, dbias = _backward(ctx, do, bias_grad=ctx.needs_input_grad[5])
        return dq, dk, dv, None, None, dbias, None


@signed
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


def _jvp_fwd_setup_context(ctx, inputs, output):
    q, k, v, _, _, _, causal, scale, bias, _, key_padding_mask = inputs
    o, _, lse = output
    ctx.causal, ctx.scale, ctx.bias_grad = causal, scale, bias is not None and bias.requires_grad
    ctx.save_for_backward(q, k, v, o, lse, bias, key_padding_mask)
    # to and lse take no gradient: without this the engine allocates and fills zeros the size of to and lse on
    # every backward (about a sixth of an eager fused forward + backward's host time, H200 trace)
    ctx.set_materialize_grads(False)


def _jvp_fwd_backward(ctx, do, _dto, _dlse):
    """o's gradient; the tangent and lse take none (every objective stops the tangent's gradient). _JVPAttention's
    backward, and the fused op's own where torch.compile differentiates it directly (torch.func.jvp traced
    through _AttentionWithJVP's rule)."""
    dq, dk, dv, dbias = _backward(ctx, do, bias_grad=ctx.bias_grad)
    return dq, dk, dv, None, None, None, None, None, dbias, None, None


_jvp_fwd_op.register_autograd(_jvp_fwd_backward, setup_context=_jvp_fwd_setup_context)


@signed
class _JVPAttention(torch.autograd.Function):
    """(o, to) from one fused launch; o differentiable (FlashAttention backward, or flm's Triton
    backward with a bias or mask), to not."""

    @staticmethod
    def forward(q, k, v, tq, tk, tv, causal, scale, bias, bias_tangent, key_padding_mask):
        return _op(_jvp_fwd_op, _jvp_fwd_impl)(q, k, v, tq, tk, tv, causal, scale, bias, bias_tangent, key_padding_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _jvp_fwd_setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])  # to, lse

    backward = staticmethod(_jvp_fwd_backward)


# ---------------------------------------------------------------------------------------------
# Backend interface (inputs already checked by flm.attention)
# ---------------------------------------------------------------------------------------------


def _expand_to_logits(bias, q, k):
    """The bias with its query and key dims expanded (a view): the kernels broadcast it over batch and
    heads, and autograd sums its gradient over the expanded dims."""
    return None if bias is None else bias.expand(bias.shape[0], bias.shape[1], q.shape[2], k.shape[2])


def _native_node_wanted(q, k, v, bias, key_padding_mask) -> bool:
    """FLM_ATTENTION_NATIVE_NODE is on and the gradient can go through aten's C++ node (flm.attention.native): eager,
    a gradient wanted, no bias or mask, and that node's backward the one flm would run."""
    if not native.enabled() or bias is not None or key_padding_mask is not None:
        return False
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if torch.compiler.is_compiling() or traced(q):
        return False
    return native.fits(q, backward_impl(q))


def attention(q, k, v, *, causal: bool, scale: float, bias=None, key_padding_mask=None) -> Tensor:
    if _native_node_wanted(q, k, v, bias, key_padding_mask):
        with torch.no_grad():
            o, lse = _fwd_impl(q, k, v, causal, scale)
        return native.node(q, k, v, o, lse, causal, scale)
    fn = _Attention if torch.compiler.is_compiling() else _AttentionWithJVP
    return apply(fn, q, k, v, causal, scale, _expand_to_logits(bias, q, k), key_padding_mask)[0]


def jvp_attention(
    q, k, v, tq, tk, tv, *, causal: bool, scale: float, bias=None, bias_tangent=None, key_padding_mask=None
) -> tuple[Tensor, Tensor]:
    if _native_node_wanted(q, k, v, bias, key_padding_mask):
        with torch.no_grad():
            o, to, lse = _jvp_fwd_impl(q, k, v, tq, tk, tv, causal, scale)
        return native.node(q, k, v, o, lse, causal, scale), to
    # tangents never need a gradient: detaching keeps any graph they carry out of this op
    tbias = None if bias_tangent is None else _expand_to_logits(bias_tangent.detach(), q, k)
    o, to, _ = apply(
        _JVPAttention,
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
    if not torch.compiler.is_compiling():  # an unknown backward name fails here, not in the backward
        _forced(os.environ.get(BACKWARD_ENV, "auto"))
        if device.type == "cuda":
            _settle_cudnn(device, dtype, head_dim)
