"""FlashAttention-2 backward in Triton: dq, dk, dv from (do, q, k, v, o, lse).

flm's fallback where FlashAttention's own backward cannot run: fp32 inputs, the CPU (Triton
interpreter) and shapes the CUDA kernels do not take. Two kernels, as in FA2: one program per key
block accumulates dk and dv over the query blocks, one per query block accumulates dq over the key
blocks, both recomputing P = exp(scale * q k^T - lse) and dS = P * (dO V^T - delta).
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
    H,
    LQ,
    LKV,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
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
        if CAUSAL:
            keep = keep & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.where(keep, tl.exp(s_t - lse[None, :]), 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
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
    H,
    LQ,
    LKV,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
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
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_off = off_bh * LKV * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        kv_mask = (offs_n[:, None] < LKV) & d_ok[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        keep = m_ok[:, None] & (offs_n[None, :] < LKV)
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    tl.store(DQ + q_off, (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------


def attention_bwd(do, q, k, v, o, lse, *, causal: bool, scale: float):
    """(dq, dk, dv) of softmax attention given the forward's o and natural-log lse (B, H, Lq)."""
    b, h, lq, d = q.shape
    lkv = k.shape[2]
    q, k, v, do, lse = (x.contiguous() for x in (q, k, v, do, lse))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if lq == 0 or lkv == 0 or b * h == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = (o.float() * do.float()).sum(-1).contiguous()  # rowsum(dO * O), (B, H, Lq)
    block_d = max(16, triton.next_power_of_2(d))
    block = 16 if interpreted() or block_d > 128 else 32
    meta = dict(
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block,
        BLOCK_N=block,
        CAUSAL=causal,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    _bwd_dkdv_kernel[(triton.cdiv(lkv, block), b * h)](q, k, v, do, lse, delta, dk, dv, h, lq, lkv, scale, **meta)
    _bwd_dq_kernel[(triton.cdiv(lq, block), b * h)](q, k, v, do, lse, delta, dq, h, lq, lkv, scale, **meta)
    return dq, dk, dv


__all__ = ["attention_bwd"]
