"""FlashAttention-2 backward in Triton: dq, dk, dv from (do, q, k, v, o, lse).

flm's fallback where FlashAttention's own backward cannot run: fp32 inputs, the CPU (Triton
interpreter) and shapes the CUDA kernels do not take. Two kernels, as in FA2: one program per key
block accumulates dk and dv over the query blocks, one per query block accumulates dq over the key
blocks, both recomputing P = exp(scale * q k^T - lse) and dS = P * (dO V^T - delta).

It is also the backward of attention with an additive bias or a key-padding mask (FlashAttention's
takes neither): P = exp(scale * q k^T + bias - lse) with P = 0 at padded keys, and the bias gradient
is dS itself (the logits' gradient, before the scale that dq and dk carry), summed over the batch and
heads the bias broadcasts over: the dk/dv kernel, which meets every (query, key) pair of a head once,
stores it, or adds it atomically (fp32, in no fixed order) where several batch elements or heads share
one bias entry.
"""

import torch
import triton
import triton.language as tl

from flm.kernels.attention_fwd import interpreted

# ---------------------------------------------------------------------------------------------
# Kernels (inputs contiguous (B, H, L, D); lse and delta contiguous (B, H, Lq))
# ---------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    BIAS,
    KPM,
    DBIAS,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    stride_dbb,
    stride_dbh,
    stride_dbm,
    H,
    LQ,
    LKV,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BIAS_GRAD_ATOMIC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_n = tl.program_id(0)
    off_bh = tl.program_id(1).to(tl.int64)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (offs_n[:, None] < LKV) & d_ok[None, :]
    kv_off = off_bh * LKV * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0  # earlier queries see none of these keys
    if HAS_BIAS or HAS_MASK:
        off_b = off_bh // H
        off_h = off_bh % H
    if HAS_BIAS:  # transposed tiles: key n, query m at [n, m]
        bias_cols = BIAS + off_b * stride_bb + off_h * stride_bh + offs_n[:, None] * stride_bn
    if BIAS_GRAD:  # dbias is contiguous along keys
        dbias_cols = DBIAS + off_b * stride_dbb + off_h * stride_dbh + offs_n[:, None]
    if HAS_MASK:
        key_ok = tl.load(KPM + off_b * LKV + offs_n, mask=offs_n < LKV, other=0) != 0
    for start_m in range(lo, LQ, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < LQ
        q_off = off_bh * LQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + q_off, mask=q_mask, other=0.0)
        do = tl.load(DO + q_off, mask=q_mask, other=0.0)
        lse = tl.load(LSE + off_bh * LQ + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(DELTA + off_bh * LQ + offs_m, mask=m_ok, other=0.0)
        # transposed scores (BLOCK_N, BLOCK_M) so dk and dv accumulate without transposes
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale
        keep = m_ok[None, :] & (offs_n[:, None] < LKV)
        if HAS_BIAS:
            s_t += tl.load(bias_cols + offs_m[None, :] * stride_bm, mask=keep, other=0.0).to(tl.float32)
        if BIAS_GRAD:
            in_bounds = keep
        if CAUSAL:
            keep = keep & (offs_m[None, :] >= offs_n[:, None])
        if HAS_MASK:
            keep = keep & key_ok[:, None]
        p_t = tl.where(keep, tl.exp(s_t - lse[None, :]), 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if BIAS_GRAD:
            dbias_ptrs = dbias_cols + offs_m[None, :] * stride_dbm
            if BIAS_GRAD_ATOMIC:
                tl.atomic_add(dbias_ptrs, ds_t, mask=in_bounds, sem="relaxed")
            else:
                tl.store(dbias_ptrs, ds_t, mask=in_bounds)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    tl.store(DK + kv_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    BIAS,
    KPM,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    H,
    LQ,
    LKV,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < LQ
    q_off = off_bh * LQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_off, mask=q_mask, other=0.0)
    do = tl.load(DO + q_off, mask=q_mask, other=0.0)
    lse = tl.load(LSE + off_bh * LQ + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + off_bh * LQ + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum((start_m + 1) * BLOCK_M, LKV) if CAUSAL else LKV
    if HAS_BIAS or HAS_MASK:
        off_b = off_bh // H
        off_h = off_bh % H
    if HAS_BIAS:
        bias_rows = BIAS + off_b * stride_bb + off_h * stride_bh + offs_m[:, None] * stride_bm
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_off = off_bh * LKV * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = (offs_n[:, None] < LKV) & d_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = m_ok[:, None] & (offs_n[None, :] < LKV)
        if HAS_BIAS:
            s += tl.load(bias_rows + offs_n[None, :] * stride_bn, mask=keep, other=0.0).to(tl.float32)
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        if HAS_MASK:
            keep = keep & (tl.load(KPM + off_b * LKV + offs_n, mask=offs_n < LKV, other=0) != 0)[None, :]
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def attention_bwd(do, q, k, v, o, lse, *, causal: bool, scale: float, bias=None, key_padding_mask=None, bias_grad=False):
    """(dq, dk, dv, dbias) of softmax attention given the forward's o and natural-log lse (B, H, Lq).

    bias: 4 dims, (B or 1, H or 1, Lq, Lkv), any strides; key_padding_mask: bool (B, Lkv), True = attend.
    dbias (the bias's shape and dtype) only when bias_grad, else None.
    """
    b, h, lq, d = q.shape
    lkv = k.shape[2]
    q, k, v, do, lse = (x.contiguous() for x in (q, k, v, do, lse))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    has_bias, has_mask = bias is not None, key_padding_mask is not None
    # zeroed: atomics add into it, and causal programs skip the query blocks above the diagonal
    dbias = torch.zeros(bias.shape, dtype=torch.float32, device=q.device) if bias_grad else None
    assert not bias_grad or bias.shape[2:] == (lq, lkv), "expand the bias's query and key dims first"
    if lq == 0 or lkv == 0 or b * h == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None if dbias is None else dbias.to(bias.dtype)
    delta = (o.float() * do.float()).sum(-1).contiguous()  # rowsum(dO * O), (B, H, Lq)
    if has_bias or has_mask:  # a row with no key has lse = -inf: +inf makes its P = 0 instead of NaN
        lse = torch.where(lse == float("-inf"), float("inf"), lse)
    block_d = max(16, triton.next_power_of_2(d))
    block = 16 if interpreted() or block_d > 128 else 32
    meta = dict(
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block,
        BLOCK_N=block,
        CAUSAL=causal,
        HAS_BIAS=has_bias,
        HAS_MASK=has_mask,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    # absent inputs pass q and zero strides (the kernels ignore them); broadcast dims get stride 0
    bias_ = bias.expand(b, h, lq, lkv) if has_bias else q
    kpm = key_padding_mask.contiguous().view(torch.uint8) if has_mask else q
    bias_strides = bias_.stride() if has_bias else (0, 0, 0, 0)
    dbias_ = dbias.expand(b, h, lq, lkv) if bias_grad else q
    dbias_strides = dbias_.stride()[:3] if bias_grad else (0, 0, 0)
    _bwd_dkdv_kernel[(triton.cdiv(lkv, block), b * h)](
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        bias_,
        kpm,
        dbias_,
        *bias_strides,
        *dbias_strides,
        h,
        lq,
        lkv,
        scale,
        **meta,
        BIAS_GRAD=bias_grad,
        BIAS_GRAD_ATOMIC=bias_grad and 0 in dbias_strides[:2],  # a bias shared by several heads
    )
    _bwd_dq_kernel[(triton.cdiv(lq, block), b * h)](
        q, k, v, do, lse, delta, dq, bias_, kpm, *bias_strides, h, lq, lkv, scale, **meta
    )
    return dq, dk, dv, None if dbias is None else dbias.to(bias.dtype)


__all__ = ["attention_bwd"]
