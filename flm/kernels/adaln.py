"""DiT's adaLN-Zero elementwise work in fused Triton kernels: the modulated layer norm (forward, JVP, backward) and
the gated residual (JVP, backward), one kernel per pass.

Layer norm:

y = x_hat * w + b over the last dim, x_hat = (x - mean) * rstd, with w = 1 + scale when `one_plus` (adaLN), and w, b
either shared (D,) or per sample (S, 1, ..., D) against x (S, ..., D). In PyTorch ops this is a layer norm, then an
addcmul, and its backward six more kernels over (tokens, width) tensors, several in fp32 (the residual stream's
dtype): memory-bound work that made most of a graphed DiT step (docs/train_step.md, Run M). Here each pass reads its
inputs once and writes its outputs once; the per-sample sums of the backward (the gradients of w and b) are written
per block of rows and added up by one small torch.sum.

The Jacobian of x -> x_hat is symmetric, rstd * (v - mean(v) - x_hat * mean(x_hat * v)), so the JVP's tangent and
the backward's gradient are the same formula applied to tx and to gy * w.

Gated residual y = x + gate * h (gate per sample): its forward is one addcmul already; its backward (gh = gy * gate
in h's dtype, the gate's per-sample sum of gy * h) and its JVP (tx + tgate * h + gate * th) are one kernel each here,
three or four in PyTorch's ops.

Used on CUDA tensors by default ($FLM_FUSED_ADALN=0 turns it off): on an H100 the graphed DiT-S/2 steps take 0.83x
(flow matching), 0.74x (sCD) and 0.78x (rCM) of their time on PyTorch's ops (docs/train_step.md, Run N). `FORCE` runs
it on any device (tests, in Triton's CPU interpreter) or on none.
"""

import os

import torch
import triton
import triton.language as tl

from flm.kernels.launch import DirectLaunch, traced

ENV = "FLM_FUSED_ADALN"
# None: CUDA tensors unless $FLM_FUSED_ADALN=0; True: every device (tests, TRITON_INTERPRET=1); False: none
FORCE: bool | None = None
MAX_D = 8192  # one row's width in one tile; wider rows take the PyTorch ops
TILE = 4096  # elements a program holds (sm_90, D = 384-1152: 90-115 registers a thread, no spills); benchmarks/adaln.py --tiles
# the backwards' tile: at 8192 they took 0.68-0.74x their time at 4096 on an H100, D = 384-1152 (docs/train_step.md, Run N)
BWD_TILE = 8192


@triton.jit
def _tile(N, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (s, c)'s block of rows: BLOCK_R rows of sample s from row c * BLOCK_R, each BLOCK_D columns wide."""
    s, c = tl.program_id(0), tl.program_id(1)
    r = c * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask, cmask = r < N, cols < D
    rows = s.to(tl.int64) * N + r
    return s, c, rows, cols, rmask, cmask, rmask[:, None] & cmask[None, :], rows[:, None] * D + cols[None, :]


@triton.jit
def _x_hat(X, MEAN, RSTD, rows, offs, rmask, mask):
    """The forward's normalized rows again, from its saved mean and rstd; and rstd."""
    mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    return tl.where(mask, (_load_rows(X, offs, mask) - mean[:, None]) * rstd[:, None], 0.0), rstd


@triton.jit
def _load_rows(X, offs, mask):
    return tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _vector(P, s, ss, cols, cmask, ONE_PLUS: tl.constexpr):
    """One sample's (or the shared) (D,) vector, fp32, 1 + it with ONE_PLUS."""
    v = tl.load(P + s * ss + cols, mask=cmask, other=0.0).to(tl.float32)
    if ONE_PLUS:
        v = v + 1.0
    return v


@triton.jit
def _normalized_jacobian(v, x_hat, rstd, mask, D):
    """(d x_hat / d x) v per row: rstd * (v - mean(v) - x_hat * mean(x_hat * v))."""
    a = tl.sum(v, axis=1) / D
    b = tl.sum(x_hat * v, axis=1) / D
    return tl.where(mask, rstd[:, None] * (v - a[:, None] - x_hat * b[:, None]), 0.0)


@triton.jit
def _ln_fwd(
    X, W, B, Y, MEAN, RSTD, N, D, w_ss, b_ss, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ONE_PLUS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    s, c, rows, cols, rmask, cmask, mask, offs = _tile(N, D, BLOCK_R, BLOCK_D)
    x = _load_rows(X, offs, mask)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * _vector(W, s, w_ss, cols, cmask, ONE_PLUS)[None, :]
    if HAS_B:
        y = y + _vector(B, s, b_ss, cols, cmask, False)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _ln_jvp(
    X, MEAN, RSTD, W, TX, TW, TB, TY, N, D, w_ss, tw_ss, tb_ss,
    HAS_TX: tl.constexpr, HAS_W: tl.constexpr, HAS_TW: tl.constexpr, HAS_TB: tl.constexpr, ONE_PLUS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    s, c, rows, cols, rmask, cmask, mask, offs = _tile(N, D, BLOCK_R, BLOCK_D)
    x_hat, rstd = _x_hat(X, MEAN, RSTD, rows, offs, rmask, mask)
    ty = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    if HAS_TX:
        j = _normalized_jacobian(_load_rows(TX, offs, mask), x_hat, rstd, mask, D)
        if HAS_W:
            j = j * _vector(W, s, w_ss, cols, cmask, ONE_PLUS)[None, :]
        ty += j
    if HAS_TW:
        ty += x_hat * _vector(TW, s, tw_ss, cols, cmask, False)[None, :]
    if HAS_TB:
        ty += _vector(TB, s, tb_ss, cols, cmask, False)[None, :]
    tl.store(TY + offs, ty.to(TY.dtype.element_ty), mask=mask)


@triton.jit
def _ln_bwd(
    GY, X, MEAN, RSTD, W, GX, GW, GB, N, D, C, w_ss,
    HAS_W: tl.constexpr, ONE_PLUS: tl.constexpr, NEED_GW: tl.constexpr, NEED_GB: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    s, c, rows, cols, rmask, cmask, mask, offs = _tile(N, D, BLOCK_R, BLOCK_D)
    x_hat, rstd = _x_hat(X, MEAN, RSTD, rows, offs, rmask, mask)
    gy = _load_rows(GY, offs, mask)
    g = gy
    if HAS_W:
        g = gy * _vector(W, s, w_ss, cols, cmask, ONE_PLUS)[None, :]
    tl.store(GX + offs, _normalized_jacobian(g, x_hat, rstd, mask, D).to(GX.dtype.element_ty), mask=mask)
    part = (s.to(tl.int64) * C + c) * D + cols  # this block's share of the per-sample sums
    if NEED_GW:
        tl.store(GW + part, tl.sum(gy * x_hat, axis=0), mask=cmask)
    if NEED_GB:
        tl.store(GB + part, tl.sum(gy, axis=0), mask=cmask)


_DIRECT: dict = {}  # kernel -> its DirectLaunch (CUDA)


def _launch(kernel, grid, args: list, constexprs: dict, warps: int) -> None:
    """kernel[grid](*args, **constexprs): on CUDA through flm.kernels.launch.DirectLaunch (a fraction of Triton's own
    launch's host time; an eager step issues about a hundred of these), else (Triton's CPU interpreter) as usual. A
    kernel that does not build or launch here (another GPU, another Triton) fails naming the way back to PyTorch's ops."""
    try:
        if args[0].is_cuda:
            launch = _DIRECT.get(kernel) or _DIRECT.setdefault(kernel, DirectLaunch(kernel))
            launch(grid, args, constexprs, warps, 1)
        else:
            kernel[grid](*args, **constexprs, num_warps=warps)
    except Exception as err:
        name = getattr(kernel, "__name__", kernel)
        raise RuntimeError(
            f"flm's fused adaLN kernel {name} failed on {args[0].device} ({type(err).__name__}: {err}); set "
            f"{ENV}=0 to run the DiT's adaLN on PyTorch's ops instead"
        ) from err


def enabled(x: torch.Tensor) -> bool:
    """Whether x's adaLN takes these kernels: CUDA tensors unless $FLM_FUSED_ADALN=0, or as FORCE says; never inside
    torch.func's transforms or a tracing mode (flm.kernels.launch.traced: PyTorch's ops run there)."""
    on = x.is_cuda and os.environ.get(ENV, "1") != "0" if FORCE is None else FORCE
    return on and not traced(x)


def _sample_stride(v: torch.Tensor | None, x: torch.Tensor) -> int | None:
    """0 for a shared (D,) vector, its sample stride for one per sample (S, 1, ..., D) against x (S, ..., D); None
    for any other shape (the caller falls back to PyTorch ops)."""
    if v is None:
        return 0
    d = x.shape[-1]
    if v.shape[-1] != d or v.stride(-1) != 1:
        return None
    if v.numel() == d:
        return 0
    if v.dim() == x.dim() and v.shape[0] == x.shape[0] and v.numel() == v.shape[0] * d:
        return v.stride(0)
    return None


def _rows_like(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tangent of x (or h) in the layout the kernels read x in (contiguous: `plan` asks it of x)."""
    return None if t is None else t.contiguous()


def _vector_as_is(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A tangent of a per-sample or shared vector, as it comes where the kernels read it through its sample stride as
    they read the vector itself (`_sample_stride`): the DiT's are (B, 1, D) slices of the modulation's (B, 1, 6 D)
    tangent, which were copied to contiguous before (74 copies in a DiT-S/2 JVP forward), and an expanded (stride-0)
    one reads as shared. A copy only for another layout."""
    return t if t is None or _sample_stride(t, x) is not None else t.contiguous()


def plan(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
    """(samples, rows per sample) when the kernels take this call, else None."""
    d = x.shape[-1]
    if x.dim() < 2 or not x.is_contiguous() or d > MAX_D or x.numel() == 0 or not x.is_floating_point():
        return None
    strides = [_sample_stride(v, x) for v in (weight, bias)]
    if any(st is None for st in strides):
        return None
    per_sample = any(st != 0 for st in strides)
    samples = x.shape[0] if per_sample else 1
    return samples, x.numel() // d // samples


def _blocks(d: int, tile: int | None = None) -> tuple[int, int, int]:
    """(rows per program, the row's power-of-two width, warps): about `tile` (TILE) elements a program."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(16, (tile or TILE) // block_d))
    return block_r, block_d, max(1, min(8, block_r * block_d // 512))


def _vec(v: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    return dummy if v is None else v


def forward(x, weight, bias, eps: float, one_plus: bool, out_dtype: torch.dtype | None, plan_):
    """y (out_dtype, or the affine's dtype under PyTorch's promotion), mean and rstd (fp32, one per row)."""
    samples, n = plan_
    d = x.shape[-1]
    if out_dtype is None:
        out_dtype = torch.result_type(x, weight) if weight is not None else x.dtype
        out_dtype = torch.promote_types(out_dtype, bias.dtype) if bias is not None else out_dtype
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    block_r, block_d, warps = _blocks(d)
    ws, bs = _sample_stride(weight, x), _sample_stride(bias, x)
    grid = (samples, triton.cdiv(n, block_r))
    _launch(
        _ln_fwd, grid, [x, _vec(weight, x), _vec(bias, x), y, mean, rstd, n, d, ws, bs, eps],
        dict(HAS_W=weight is not None, HAS_B=bias is not None, ONE_PLUS=one_plus, BLOCK_R=block_r, BLOCK_D=block_d),
        warps,
    )  # fmt: skip
    return y, mean, rstd


def jvp(x, mean, rstd, weight, tx, tweight, tbias, one_plus: bool, out_dtype: torch.dtype, plan_):
    """The output's tangent: (d x_hat/dx) tx * w + x_hat * tw + tb, in out_dtype."""
    samples, n = plan_
    d = x.shape[-1]
    tx, tweight, tbias = _rows_like(tx), _vector_as_is(tweight, x), _vector_as_is(tbias, x)
    strides = [_sample_stride(v, x) for v in (weight, tweight, tbias)]
    ty = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block_r, block_d, warps = _blocks(d)
    _launch(
        _ln_jvp, (samples, triton.cdiv(n, block_r)),
        [x, mean, rstd, _vec(weight, x), _vec(tx, x), _vec(tweight, x), _vec(tbias, x), ty, n, d, *strides],
        dict(HAS_TX=tx is not None, HAS_W=weight is not None, HAS_TW=tweight is not None, HAS_TB=tbias is not None,
             ONE_PLUS=one_plus, BLOCK_R=block_r, BLOCK_D=block_d),
        warps,
    )  # fmt: skip
    return ty


def _per_sample_sum(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The blocks' partial sums (..., S, C, D) to `like`'s shape and dtype (summed over samples too for a shared one),
    one per leading index of `part`, if any."""
    total = part.sum(-2)
    if like.numel() == like.shape[-1]:
        total = total.sum(-2)
    return total.reshape(part.shape[:-3] + like.shape).to(like.dtype)


def backward(gy, x, mean, rstd, weight, bias, one_plus: bool, need_gw: bool, need_gb: bool, plan_):
    """gx (x's dtype), and the gradients of weight (or of the scale, with one_plus) and bias, or None."""
    samples, n = plan_
    d = x.shape[-1]
    block_r, block_d, warps = _blocks(d, BWD_TILE)
    blocks = triton.cdiv(n, block_r)
    need_gw, need_gb = need_gw and weight is not None, need_gb and bias is not None
    gx = torch.empty_like(x)
    # the two gradients' partial sums in one buffer, reduced and cast together when they share a shape and dtype (the
    # DiT's shift and scale): two ops instead of four for each of a step's adaLN norms
    parts = torch.empty((need_gw + need_gb, samples, blocks, d), dtype=torch.float32, device=x.device)
    gw, gb = parts[0] if need_gw else None, parts[-1] if need_gb else None
    _launch(
        _ln_bwd, (samples, blocks),
        [gy.contiguous(), x, mean, rstd, _vec(weight, x), gx, _vec(gw, x), _vec(gb, x), n, d, blocks,
         _sample_stride(weight, x)],
        dict(HAS_W=weight is not None, ONE_PLUS=one_plus, NEED_GW=need_gw, NEED_GB=need_gb, BLOCK_R=block_r,
             BLOCK_D=block_d),
        warps,
    )  # fmt: skip
    if need_gw and need_gb and weight.shape == bias.shape and weight.dtype == bias.dtype:
        return (gx, *_per_sample_sum(parts, weight).unbind(0))
    return (
        gx,
        None if gw is None else _per_sample_sum(gw, weight),
        None if gb is None else _per_sample_sum(gb, bias),
    )


# --------------------------------------------------------------------------------------------
# Gated residual y = x + gate * h
# --------------------------------------------------------------------------------------------


@triton.jit
def _gate_bwd(
    GY, H, GATE, GH, GG, N, D, C, g_ss,
    NEED_GH: tl.constexpr, NEED_GG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    s, c, rows, cols, rmask, cmask, mask, offs = _tile(N, D, BLOCK_R, BLOCK_D)
    gy = _load_rows(GY, offs, mask)
    if NEED_GH:
        gh = gy * _vector(GATE, s, g_ss, cols, cmask, False)[None, :]
        tl.store(GH + offs, gh.to(GH.dtype.element_ty), mask=mask)
    if NEED_GG:
        part = (s.to(tl.int64) * C + c) * D + cols
        tl.store(GG + part, tl.sum(gy * _load_rows(H, offs, mask), axis=0), mask=cmask)


@triton.jit
def _gate_jvp(
    TX, GATE, H, TG, TH, TY, N, D, g_ss, tg_ss,
    HAS_TX: tl.constexpr, HAS_TG: tl.constexpr, HAS_TH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    s, c, rows, cols, rmask, cmask, mask, offs = _tile(N, D, BLOCK_R, BLOCK_D)
    ty = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    if HAS_TX:
        ty += _load_rows(TX, offs, mask)
    if HAS_TG:
        ty += _vector(TG, s, tg_ss, cols, cmask, False)[None, :] * _load_rows(H, offs, mask)
    if HAS_TH:
        ty += _vector(GATE, s, g_ss, cols, cmask, False)[None, :] * _load_rows(TH, offs, mask)
    tl.store(TY + offs, ty.to(TY.dtype.element_ty), mask=mask)


def gate_plan(x: torch.Tensor, gate: torch.Tensor, h: torch.Tensor):
    """(samples, rows per sample) when the gated residual's kernels take x + gate * h, else None."""
    if x.shape != h.shape or not h.is_contiguous():
        return None
    return plan(h, gate, None)


def gate_jvp(gate, h, tx, tgate, th, out_dtype: torch.dtype, plan_):
    """The tangent of x + gate * h: tx + tgate * h + gate * th, in out_dtype."""
    samples, n = plan_
    d = h.shape[-1]
    tx, tgate, th = _rows_like(tx), _vector_as_is(tgate, h), _rows_like(th)
    ty = torch.empty(h.shape, dtype=out_dtype, device=h.device)
    block_r, block_d, warps = _blocks(d)
    _launch(
        _gate_jvp, (samples, triton.cdiv(n, block_r)),
        [_vec(tx, h), gate, h, _vec(tgate, h), _vec(th, h), ty, n, d, _sample_stride(gate, h),
         _sample_stride(tgate, h) if tgate is not None else 0],
        dict(HAS_TX=tx is not None, HAS_TG=tgate is not None, HAS_TH=th is not None, BLOCK_R=block_r,
             BLOCK_D=block_d),
        warps,
    )  # fmt: skip
    return ty


def gate_backward(gy, gate, h, need_gate: bool, need_h: bool, plan_):
    """The gradients of gate (its dtype and shape) and of h (its dtype), or None where not needed."""
    samples, n = plan_
    d = h.shape[-1]
    block_r, block_d, warps = _blocks(d, BWD_TILE)
    blocks = triton.cdiv(n, block_r)
    gh = torch.empty_like(h) if need_h else None
    gg = torch.empty((samples, blocks, d), dtype=torch.float32, device=h.device) if need_gate else None
    _launch(
        _gate_bwd, (samples, blocks),
        [gy.contiguous(), h, gate, _vec(gh, h), _vec(gg, h), n, d, blocks, _sample_stride(gate, h)],
        dict(NEED_GH=need_h, NEED_GG=need_gate, BLOCK_R=block_r, BLOCK_D=block_d),
        warps,
    )  # fmt: skip
    return None if gg is None else _per_sample_sum(gg, gate), gh
