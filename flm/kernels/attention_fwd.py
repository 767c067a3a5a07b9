"""Fused attention forward with its JVP: O, tO and the log-sum-exp in one FlashAttention-2 pass.

For one query row, with s_j = scale * q.k_j, p_j = exp(s_j - m), l = sum_j p_j and O = sum_j p_j v_j / l,
the tangent along (tq, tk, tv) is

    ts_j = scale * (tq.k_j + q.tk_j)
    tO   = (sum_j p_j tv_j + sum_j p_j ts_j v_j - r O) / l,      r = sum_j p_j ts_j

so besides FlashAttention's accumulator (P V) the kernel keeps T = P tV + (P * tS) V and r, rescaled
by the running max like P V: six matmuls per key block instead of two. Both tangent products go into
one accumulator, which keeps two (BLOCK_M, head dim) fp32 tiles in registers instead of three (the
limit at head dim 128). With HAS_TANGENT
off the same kernel is a plain FlashAttention-2 forward (O and the log-sum-exp).

An additive bias b (HAS_BIAS) enters as s_j = scale * q.k_j + b_j, and its tangent tb (HAS_BIAS_TANGENT)
as ts_j = scale * (tq.k_j + q.tk_j) + tb_j; a key-padding mask (HAS_MASK) sets s_j = -inf at padded keys.
The bias is read through its strides, so a bias broadcast over batch or heads (stride 0) is read in place.
A row whose every logit is -inf gets O = tO = 0 and lse = -inf. With the three flags off the kernel
compiles to the code it had before they existed.

Layouts are (batch, heads, tokens, head_dim) with arbitrary strides for every input. A head dim that is
not a power of two is split into two column chunks, read in place (no padded copies): its largest
power of two BLOCK_D and a remainder tile BLOCK_D_REM, a power of two of at least 16 (tl.dot's smallest
K and N), whose columns past the head dim load as 0 and are not stored. 72 = 64 + 8 runs as 64 + 16,
80 = 64 + 16, 96 = 64 + 32. Above 128 (160, 192, ...) the split kernel hit an illegal memory access on an
H200 (Triton 3.6, not found on the CPU interpreter), so those head dims are zero-padded to 256 in copies,
as every non-power-of-two head dim was before the split. q k^T is the sum of the two chunks' products, and P V and
the tangent accumulator keep one tile per chunk. With BLOCK_D_REM = 0 (a power of two) the kernel is the
single-chunk one it was before the split; the main chunk's loads carry no head-dim mask either way.
"""

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

from flm import env
from flm.kernels.launch import DirectLaunch, TensorDescriptor, hopper_or_later


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rows(ptr, off_b, off_h, stride_b, stride_h):
    """Pointer to row 0 of head (off_b, off_h); the offset is a multiple of 8 elements."""
    return ptr + tl.multiple_of(off_b * stride_b + off_h * stride_h, 8)


@triton.jit
def _head(
    ptr,
    off_b,
    off_h,
    stride_b,
    stride_h,
    rows,
    stride_row,
    HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """A tensor descriptor (Hopper's TMA) of head (off_b, off_h)'s (rows, HEAD_DIM) matrix, read in
    (BLOCK_ROWS, BLOCK_COLS) blocks; rows and columns past its end read as 0."""
    return tl.make_tensor_descriptor(
        _rows(ptr, off_b, off_h, stride_b, stride_h),
        shape=[rows, HEAD_DIM],
        strides=[stride_row, 1],
        block_shape=[BLOCK_ROWS, BLOCK_COLS],
    )


@triton.jit
def _block(src, off_b, off_h, row, col, TMA: tl.constexpr):
    """The block at (row, col) of head (off_b, off_h): from its own 2-D descriptor (TMA 1), or from a 4-D descriptor of
    the whole (batch, heads, tokens, head dim) tensor (TMA 2), whose block's two leading dims are 1."""
    if TMA == 2:
        x = src.load([off_b.to(tl.int32), off_h.to(tl.int32), row, col])  # the kernel holds them as int64
        return x.reshape(x.shape[2], x.shape[3])
    else:
        return src.load([row, col])


@triton.jit
def _key_block_t(src, off_b, off_h, start_n, col, mask, pad, TMA: tl.constexpr):
    """K^T's (head-dim chunk, BLOCK_N) block at key start_n: from a descriptor at column col (read as keys x
    head dim, transposed in shared memory for the dot), or from pointers already at the block."""
    if TMA:
        return tl.trans(_block(src, off_b, off_h, start_n, col, TMA))
    else:
        return tl.load(src, mask=mask, other=pad)


@triton.jit
def _value_block(src, off_b, off_h, start_n, col, mask, pad, TMA: tl.constexpr):
    """V's (BLOCK_N, head-dim chunk) block at key start_n, as _key_block_t reads K's."""
    if TMA:
        return _block(src, off_b, off_h, start_n, col, TMA)
    else:
        return tl.load(src, mask=mask, other=pad)


@triton.jit
def _fwd_inner(
    acc,
    acc_r,
    acc_t,
    acc_t_r,
    l_i,
    m_i,
    r_i,
    q,
    q_r,
    tq,
    tq_r,
    k_ptrs,
    kr_ptrs,
    v_ptrs,
    vr_ptrs,
    tk_ptrs,
    tkr_ptrs,
    tv_ptrs,
    tvr_ptrs,
    stride_kn,
    stride_vn,
    stride_tkn,
    stride_tvn,
    bias_ptrs,
    tbias_ptrs,
    stride_bn,
    stride_tbn,
    kpm_ptrs,
    offs_m,
    offs_n,
    off_b,
    off_h,
    lo,
    hi,
    LKV,
    scale,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_REM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TANGENT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_BIAS_TANGENT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Accumulate key blocks [lo, hi). MASK: the range holds the ragged end or the causal diagonal.
    The *_r names are the head dim's remainder chunk (used only when BLOCK_D_REM > 0). With TMA the *_ptrs
    are tensor descriptors (of one head's (tokens, head dim) rows, TMA 1, or of the whole tensor, TMA 2), which read
    keys past the end and columns past the head dim as 0 by themselves."""
    if not TMA:
        k_ptrs += lo * stride_kn
        v_ptrs += lo * stride_vn
        if BLOCK_D_REM > 0:
            kr_ptrs += lo * stride_kn
            vr_ptrs += lo * stride_vn
        if HAS_TANGENT:
            tk_ptrs += lo * stride_tkn
            tv_ptrs += lo * stride_tvn
            if BLOCK_D_REM > 0:
                tkr_ptrs += lo * stride_tkn
                tvr_ptrs += lo * stride_tvn
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        # K^T block (BLOCK_D, BLOCK_N) and V block (BLOCK_N, BLOCK_D); keys past the end load as 0
        if MASK:
            kt_mask = cols[None, :] < LKV
            v_mask = cols[:, None] < LKV
            pad = 0.0
        else:
            kt_mask = None
            v_mask = None
            pad = None
        if BLOCK_D_REM > 0:  # the remainder's columns past the head dim load as 0 too
            d_ok = BLOCK_D + tl.arange(0, BLOCK_D_REM) < HEAD_DIM
            ktr_mask = d_ok[:, None] & kt_mask if MASK else d_ok[:, None]
            vr_mask = d_ok[None, :] & v_mask if MASK else d_ok[None, :]
        kt = _key_block_t(k_ptrs, off_b, off_h, start_n, 0, kt_mask, pad, TMA)
        s = tl.dot(q, kt, input_precision=PRECISION)
        if BLOCK_D_REM > 0:
            kt_r = _key_block_t(kr_ptrs, off_b, off_h, start_n, BLOCK_D, ktr_mask, 0.0, TMA)
            s = tl.dot(q_r, kt_r, s, input_precision=PRECISION)
        s = s * qk_scale  # log2 units
        if HAS_BIAS:
            b = tl.load(bias_ptrs + cols[None, :] * stride_bn, mask=kt_mask, other=pad)
            s += b.to(tl.float32) * 1.4426950408889634
        if HAS_MASK:
            key_ok = tl.load(kpm_ptrs + cols[None, :], mask=kt_mask, other=pad)  # (1, BLOCK_N)
            s = tl.where(key_ok != 0, s, float("-inf"))
        if MASK:
            keep = cols[None, :] < LKV
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet keeps m = -inf: shift by 0 so exp2 gives 0, not NaN (a chain of three `or`s,
        # unparenthesised, does not compile in older Triton)
        if MASK or (HAS_BIAS or HAS_MASK):
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _value_block(v_ptrs, off_b, off_h, start_n, 0, v_mask, pad, TMA)
        p_in = p.to(v.dtype)
        if BLOCK_D_REM > 0:
            acc_r = acc_r * alpha[:, None]
            v_r = _value_block(vr_ptrs, off_b, off_h, start_n, BLOCK_D, vr_mask, 0.0, TMA)
        if HAS_TANGENT:
            tkt = _key_block_t(tk_ptrs, off_b, off_h, start_n, 0, kt_mask, pad, TMA)
            ts = tl.dot(tq, kt, input_precision=PRECISION)
            ts = tl.dot(q, tkt, ts, input_precision=PRECISION)
            if BLOCK_D_REM > 0:
                tkt_r = _key_block_t(tkr_ptrs, off_b, off_h, start_n, BLOCK_D, ktr_mask, 0.0, TMA)
                ts = tl.dot(tq_r, kt_r, ts, input_precision=PRECISION)
                ts = tl.dot(q_r, tkt_r, ts, input_precision=PRECISION)
            ts = ts * scale
            if HAS_BIAS_TANGENT:
                ts += tl.load(tbias_ptrs + cols[None, :] * stride_tbn, mask=kt_mask, other=pad).to(tl.float32)
            h = p * ts
            r_i = r_i * alpha + tl.sum(h, 1)
            acc_t = acc_t * alpha[:, None]
            tv = _value_block(tv_ptrs, off_b, off_h, start_n, 0, v_mask, pad, TMA)
            acc_t = tl.dot(p_in, tv, acc_t, input_precision=PRECISION)
            acc_t = tl.dot(h.to(v.dtype), v, acc_t, input_precision=PRECISION)
            if not TMA:
                tk_ptrs += BLOCK_N * stride_tkn
                tv_ptrs += BLOCK_N * stride_tvn
            if BLOCK_D_REM > 0:
                acc_t_r = acc_t_r * alpha[:, None]
                tv_r = _value_block(tvr_ptrs, off_b, off_h, start_n, BLOCK_D, vr_mask, 0.0, TMA)
                acc_t_r = tl.dot(p_in, tv_r, acc_t_r, input_precision=PRECISION)
                acc_t_r = tl.dot(h.to(v.dtype), v_r, acc_t_r, input_precision=PRECISION)
                if not TMA:
                    tkr_ptrs += BLOCK_N * stride_tkn
                    tvr_ptrs += BLOCK_N * stride_tvn
        acc = tl.dot(p_in, v, acc, input_precision=PRECISION)
        m_i = m_new
        if not TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
        if BLOCK_D_REM > 0:
            acc_r = tl.dot(p_in, v_r, acc_r, input_precision=PRECISION)
            if not TMA:
                kr_ptrs += BLOCK_N * stride_kn
                vr_ptrs += BLOCK_N * stride_vn
    return acc, acc_r, acc_t, acc_t_r, l_i, m_i, r_i


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    TQ,
    TK,
    TV,
    O,
    TO,
    LSE,
    BIAS,
    TBIAS,
    KPM,
    QR,
    KR,
    VR,
    TQR,
    TKR,
    TVR,
    stride_qb,
    stride_qh,
    stride_qm,  # head dim has unit stride (the wrapper ensures it)
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_tqb,
    stride_tqh,
    stride_tqm,
    stride_tkb,
    stride_tkh,
    stride_tkn,
    stride_tvb,
    stride_tvh,
    stride_tvn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    stride_tbb,
    stride_tbh,
    stride_tbm,
    stride_tbn,
    H,
    LQ,
    LKV,
    scale,
    LQ_BUCKET,
    LKV_BUCKET,  # autotune key only: tuned configs are shared by lengths in one bucket
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # the head dim's largest power of two (all of it, if it is one)
    BLOCK_D_REM: tl.constexpr,  # a tile for the rest (>= 16, masked past HEAD_DIM); 0: no rest
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TANGENT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_BIAS_TANGENT: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,  # q, k, v and the tangents read through tensor descriptors (Hopper's TMA; no bias or mask): 0 no,
    # 1 each program builds its head's, 2 the host built them (Q ... TV and the remainder's QR ... TVR are descriptors)
):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = offs_m[:, None] < LQ

    # every row starts 16-byte aligned: the wrapper keeps strides multiples of 8 elements. A launch marks
    # only multiples of 16, and tl.multiple_of on a kernel argument is dropped, so where a head dim such as
    # 72 makes row strides odd multiples of 8 the kernel states it as arithmetic (x // 8 * 8). Unproven,
    # the loads could not become 16-byte async copies and the key loop would not be pipelined at all.
    if BLOCK_D_REM > 0:
        stride_qm = stride_qm // 8 * 8
        stride_kn = stride_kn // 8 * 8
        stride_vn = stride_vn // 8 * 8
        stride_tqm = stride_tqm // 8 * 8
        stride_tkn = stride_tkn // 8 * 8
        stride_tvn = stride_tvn // 8 * 8
        stride_om = stride_om // 8 * 8
    # q and its tangent, read once per program (through descriptors too with TMA, which holds fewer registers: at head
    # dim 128, 216 against 254 by benchmarks/attention_ptxas.py); the remainder chunk: columns BLOCK_D .. BLOCK_D +
    # BLOCK_D_REM - 1, zero past HEAD_DIM
    if BLOCK_D_REM > 0:
        offs_dr = BLOCK_D + tl.arange(0, BLOCK_D_REM)
        qr_mask = q_mask & (offs_dr[None, :] < HEAD_DIM)
    if TMA == 2:  # the host built descriptors of the whole tensors; they come in the pointers' places (*R: the remainder's)
        rows_m = start_m * BLOCK_M
        q = _block(Q, off_b, off_h, rows_m, 0, TMA)
        if HAS_TANGENT:
            tq = _block(TQ, off_b, off_h, rows_m, 0, TMA)
        if BLOCK_D_REM > 0:
            q_r = _block(QR, off_b, off_h, rows_m, BLOCK_D, TMA)
            if HAS_TANGENT:
                tq_r = _block(TQR, off_b, off_h, rows_m, BLOCK_D, TMA)
    elif TMA == 1:  # each program builds its head's descriptors
        rows_m = start_m * BLOCK_M
        q = _head(Q, off_b, off_h, stride_qb, stride_qh, LQ, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D).load([rows_m, 0])
        if HAS_TANGENT:
            tq = _head(TQ, off_b, off_h, stride_tqb, stride_tqh, LQ, stride_tqm, HEAD_DIM, BLOCK_M, BLOCK_D).load([rows_m, 0])
        if BLOCK_D_REM > 0:
            q_r = _head(Q, off_b, off_h, stride_qb, stride_qh, LQ, stride_qm, HEAD_DIM, BLOCK_M, BLOCK_D_REM)
            q_r = q_r.load([rows_m, BLOCK_D])
            if HAS_TANGENT:
                tq_r = _head(TQ, off_b, off_h, stride_tqb, stride_tqh, LQ, stride_tqm, HEAD_DIM, BLOCK_M, BLOCK_D_REM)
                tq_r = tq_r.load([rows_m, BLOCK_D])
    else:
        q_ptrs = _rows(Q, off_b, off_h, stride_qb, stride_qh) + offs_m[:, None] * stride_qm + offs_d[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        if HAS_TANGENT:
            tq_ptrs = _rows(TQ, off_b, off_h, stride_tqb, stride_tqh) + offs_m[:, None] * stride_tqm + offs_d[None, :]
            tq = tl.load(tq_ptrs, mask=q_mask, other=0.0)
        if BLOCK_D_REM > 0:
            qr_ptrs = _rows(Q, off_b, off_h, stride_qb, stride_qh) + offs_m[:, None] * stride_qm + offs_dr[None, :]
            q_r = tl.load(qr_ptrs, mask=qr_mask, other=0.0)
            if HAS_TANGENT:
                tqr_ptrs = _rows(TQ, off_b, off_h, stride_tqb, stride_tqh) + offs_m[:, None] * stride_tqm + offs_dr[None, :]
                tq_r = tl.load(tqr_ptrs, mask=qr_mask, other=0.0)
    if not HAS_TANGENT:  # unused placeholders from here on
        tq = q
    if BLOCK_D_REM == 0:
        q_r = q
    if BLOCK_D_REM == 0 or not HAS_TANGENT:
        tq_r = q_r if BLOCK_D_REM > 0 else tq
    # k, v and their tangents, read every key block: tensor descriptors of one head's rows (TMA), or pointer tiles. *_r:
    # the remainder chunk's (descriptors BLOCK_D_REM wide read at column BLOCK_D; pointers at its columns)
    if TMA == 2:
        k_ptrs = K
        v_ptrs = V
        if HAS_TANGENT:
            tk_ptrs = TK
            tv_ptrs = TV
        if BLOCK_D_REM > 0:
            kr_ptrs = KR
            vr_ptrs = VR
            if HAS_TANGENT:
                tkr_ptrs = TKR
                tvr_ptrs = TVR
    elif TMA == 1:
        k_ptrs = _head(K, off_b, off_h, stride_kb, stride_kh, LKV, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D)
        v_ptrs = _head(V, off_b, off_h, stride_vb, stride_vh, LKV, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D)
        if HAS_TANGENT:
            tk_ptrs = _head(TK, off_b, off_h, stride_tkb, stride_tkh, LKV, stride_tkn, HEAD_DIM, BLOCK_N, BLOCK_D)
            tv_ptrs = _head(TV, off_b, off_h, stride_tvb, stride_tvh, LKV, stride_tvn, HEAD_DIM, BLOCK_N, BLOCK_D)
        if BLOCK_D_REM > 0:
            kr_ptrs = _head(K, off_b, off_h, stride_kb, stride_kh, LKV, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D_REM)
            vr_ptrs = _head(V, off_b, off_h, stride_vb, stride_vh, LKV, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D_REM)
            if HAS_TANGENT:
                tkr_ptrs = _head(TK, off_b, off_h, stride_tkb, stride_tkh, LKV, stride_tkn, HEAD_DIM, BLOCK_N, BLOCK_D_REM)
                tvr_ptrs = _head(TV, off_b, off_h, stride_tvb, stride_tvh, LKV, stride_tvn, HEAD_DIM, BLOCK_N, BLOCK_D_REM)
    else:
        k_ptrs = _rows(K, off_b, off_h, stride_kb, stride_kh) + offs_d[:, None] + offs_n[None, :] * stride_kn
        v_ptrs = _rows(V, off_b, off_h, stride_vb, stride_vh) + offs_n[:, None] * stride_vn + offs_d[None, :]
        if HAS_TANGENT:
            tk_ptrs = _rows(TK, off_b, off_h, stride_tkb, stride_tkh) + offs_d[:, None] + offs_n[None, :] * stride_tkn
            tv_ptrs = _rows(TV, off_b, off_h, stride_tvb, stride_tvh) + offs_n[:, None] * stride_tvn + offs_d[None, :]
        if BLOCK_D_REM > 0:
            kr_ptrs = _rows(K, off_b, off_h, stride_kb, stride_kh) + offs_dr[:, None] + offs_n[None, :] * stride_kn
            vr_ptrs = _rows(V, off_b, off_h, stride_vb, stride_vh) + offs_n[:, None] * stride_vn + offs_dr[None, :]
            if HAS_TANGENT:
                tkr_ptrs = _rows(TK, off_b, off_h, stride_tkb, stride_tkh) + offs_dr[:, None] + offs_n[None, :] * stride_tkn
                tvr_ptrs = _rows(TV, off_b, off_h, stride_tvb, stride_tvh) + offs_n[:, None] * stride_tvn + offs_dr[None, :]
    if not HAS_TANGENT:  # unused placeholders
        tk_ptrs = k_ptrs
        tv_ptrs = v_ptrs
    if BLOCK_D_REM == 0:
        kr_ptrs = k_ptrs
        vr_ptrs = v_ptrs
    if BLOCK_D_REM == 0 or not HAS_TANGENT:
        tkr_ptrs = kr_ptrs
        tvr_ptrs = vr_ptrs
    if HAS_BIAS:
        # (BLOCK_M, 1) row pointers; rows past Lq read row Lq - 1 (never stored), so only keys need load masks
        rows = tl.minimum(offs_m, LQ - 1)[:, None]
        bias_ptrs = BIAS + off_b * stride_bb + off_h * stride_bh + rows * stride_bm
        tbias_ptrs = TBIAS + off_b * stride_tbb + off_h * stride_tbh + rows * stride_tbm if HAS_BIAS_TANGENT else bias_ptrs
    else:
        bias_ptrs = BIAS
        tbias_ptrs = BIAS
    kpm_ptrs = KPM + off_b * LKV if HAS_MASK else KPM  # (B, Lkv) contiguous, 0 = padded key

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    r_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BLOCK_D_REM > 0:
        acc_r = tl.zeros([BLOCK_M, BLOCK_D_REM], dtype=tl.float32)
        acc_t_r = tl.zeros([BLOCK_M, BLOCK_D_REM], dtype=tl.float32)
    else:
        acc_r = acc
        acc_t_r = acc_t
    qk_scale = scale * 1.4426950408889634

    # key blocks needing no mask first, then the ragged end (or causal diagonal) with masks
    if CAUSAL:
        full_hi = start_m * BLOCK_M  # BLOCK_M % BLOCK_N == 0, and Lq == Lkv
        tail_hi = tl.minimum((start_m + 1) * BLOCK_M, LKV)
    else:
        full_hi = (LKV // BLOCK_N) * BLOCK_N
        tail_hi = LKV
    acc, acc_r, acc_t, acc_t_r, l_i, m_i, r_i = _fwd_inner(
        acc,
        acc_r,
        acc_t,
        acc_t_r,
        l_i,
        m_i,
        r_i,
        q,
        q_r,
        tq,
        tq_r,
        k_ptrs,
        kr_ptrs,
        v_ptrs,
        vr_ptrs,
        tk_ptrs,
        tkr_ptrs,
        tv_ptrs,
        tvr_ptrs,
        stride_kn,
        stride_vn,
        stride_tkn,
        stride_tvn,
        bias_ptrs,
        tbias_ptrs,
        stride_bn,
        stride_tbn,
        kpm_ptrs,
        offs_m,
        offs_n,
        off_b,
        off_h,
        0,
        full_hi,
        LKV,
        scale,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_D_REM,
        BLOCK_N,
        HAS_TANGENT,
        HAS_BIAS,
        HAS_BIAS_TANGENT,
        HAS_MASK,
        False,
        CAUSAL,
        PRECISION,
        TMA,
    )
    acc, acc_r, acc_t, acc_t_r, l_i, m_i, r_i = _fwd_inner(
        acc,
        acc_r,
        acc_t,
        acc_t_r,
        l_i,
        m_i,
        r_i,
        q,
        q_r,
        tq,
        tq_r,
        k_ptrs,
        kr_ptrs,
        v_ptrs,
        vr_ptrs,
        tk_ptrs,
        tkr_ptrs,
        tv_ptrs,
        tvr_ptrs,
        stride_kn,
        stride_vn,
        stride_tkn,
        stride_tvn,
        bias_ptrs,
        tbias_ptrs,
        stride_bn,
        stride_tbn,
        kpm_ptrs,
        offs_m,
        offs_n,
        off_b,
        off_h,
        full_hi,
        tail_hi,
        LKV,
        scale,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_D_REM,
        BLOCK_N,
        HAS_TANGENT,
        HAS_BIAS,
        HAS_BIAS_TANGENT,
        HAS_MASK,
        True,
        CAUSAL,
        PRECISION,
        TMA,
    )

    # epilogue; a row with no key at all (l = 0) gets O = tO = 0 and lse = -inf instead of NaN
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_rows = tl.multiple_of(off_b * stride_ob + off_h * stride_oh, 8) + offs_m[:, None] * stride_om
    o_off = o_rows + offs_d[None, :]
    tl.store(O + o_off, o.to(O.dtype.element_ty), mask=q_mask)
    if HAS_TANGENT:
        to = (acc_t - r_i[:, None] * o) / l_safe[:, None]
        tl.store(TO + o_off, to.to(TO.dtype.element_ty), mask=q_mask)
    if BLOCK_D_REM > 0:
        o_r = acc_r / l_safe[:, None]
        or_off = o_rows + offs_dr[None, :]
        tl.store(O + or_off, o_r.to(O.dtype.element_ty), mask=qr_mask)
        if HAS_TANGENT:
            to_r = (acc_t_r - r_i[:, None] * o_r) / l_safe[:, None]
            tl.store(TO + or_off, to_r.to(TO.dtype.element_ty), mask=qr_mask)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + off_bh.to(tl.int64) * LQ + offs_m, lse, mask=offs_m < LQ)


# ---------------------------------------------------------------------------------------------
# Launch configuration: tuned once per (head dim, dtype, causal, tangent, bias, mask, length bucket)
# ---------------------------------------------------------------------------------------------


# Candidates by tile width BLOCK_D + BLOCK_D_REM (a head dim takes the first width at least its own),
# (BLOCK_M, BLOCK_N, num_warps, num_stages): the best of a sweep, and few, so that a new shape tunes in
# seconds. BLOCK_M is a multiple of BLOCK_N (the causal loop split relies on it).
_CANDIDATES = {  # powers of two: from benchmarks/attention_configs.py on an H200 (bf16, 4096 tokens)
    64: [(128, 64, 8, 4), (64, 64, 4, 3), (128, 64, 8, 3)],
    # 72 and 80 (64 + 16), 88 and 96 (64 + 32): not swept on a GPU yet. Compiled for sm_90 (Triton 3.8,
    # bf16, tangents) these fit shared memory and spill least: at 80 wide 200 / 160 / 120 KiB, at 96 wide
    # 192 / 144 / 144 KiB (96 wide with 128 x 64 blocks and 4 stages needs 240 KiB, more than 227)
    80: [(128, 64, 8, 4), (128, 64, 8, 3), (128, 32, 8, 4)],
    96: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 4)],
    128: [(128, 64, 8, 2), (128, 32, 8, 4)],  # the latter best at 256 and 1024 tokens
    256: [(64, 32, 4, 2), (128, 32, 8, 1)],
}
# With tensor descriptors the host builds (TMA 2), where they fit (`tma_fits`): the fastest of `benchmarks/
# attention_configs.py --loads tma-host` per tile width at 4096, 1024 and 256 tokens on an H100 (bf16; the descriptors
# free 36-87 registers, so larger tiles fit: docs/attention.md, fifty-sixth day). Other widths try the pointers' list.
_HOST_TMA_CANDIDATES = {
    64: [(128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
    80: [(128, 128, 8, 2), (64, 64, 4, 2)],
    128: [(128, 64, 8, 2)],
}
# With a bias (and its tangent) the pipeliner stages one or two more (BLOCK_M, BLOCK_N) tiles in shared
# memory, and the fast candidates can exceed the H200's 227 KiB (an fp32 bias with its tangent; the
# tuner skips configs that do not fit). The bias path also tries this one, which fits every case
# (at most 160 KiB: head dim 128, fp32 inputs, bias and bias tangent; Triton 3.8, sm_90).
_BIAS_FALLBACK = (64, 32, 4, 2)


def candidates(tile_width: int, biased: bool) -> list[tuple[int, int, int, int]]:
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) to try with pointer loads for a tile width (BLOCK_D + BLOCK_D_REM),
    in order, with the bias fallback last when there is a bias or a mask."""
    wanted = _CANDIDATES[_width_key(tile_width)]
    return [*wanted, _BIAS_FALLBACK] if biased else list(wanted)


def _width_key(tile_width: int) -> int:
    return min(w for w in _CANDIDATES if w >= tile_width)


def launch_candidates(tile_width: int, biased: bool, loads: tuple[int, ...]) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, TMA) for each load kind in `loads` (0 pointers, 1 descriptors each
    program builds, 2 descriptors the host builds), in that order: host-built descriptors their own list where the
    width has one, the others the pointers' list."""
    pointers = candidates(tile_width, biased)
    host = _HOST_TMA_CANDIDATES.get(_width_key(tile_width), pointers)
    return [(*c, tma) for tma in loads for c in (host if tma == 2 else pointers)]


# the tuner's choice per key: later calls launch the kernel with it directly (flm.kernels.launch.DirectLaunch)
_TUNED: dict[tuple, tuple[int, int, int, int, int]] = {}
_fwd_launch = DirectLaunch(_fwd_kernel)


_UNFIT = (OutOfResources, PTXASError, CompileTimeAssertionFailure)


def autotuning() -> bool:
    """False when FLM_ATTENTION_AUTOTUNE=0 (or false, off, no): a new key takes its first candidate that fits, untimed.
    One compile per key in place of one per candidate, for test suites that launch many keys once each (tests/conftest.py
    sets it); the kernel's outputs do not depend on the config (tests/attention/test_triton_jvp_gpu.py checks every
    candidate)."""
    return env.switch("FLM_ATTENTION_AUTOTUNE", True, "time the launch configs", "the first that fits")


def first_that_fits(launch, configs):
    """The first of `configs` that `launch(config)` compiles and runs within the GPU's resources (the errors for which
    Triton's autotuner skips a config: shared memory, registers, a failed assembly); the last one's error when none
    does."""
    for i, config in enumerate(configs):
        try:
            launch(config)
            return config
        except _UNFIT:
            if i == len(configs) - 1:
                raise
    raise ValueError("no launch configuration to try")


def fastest(launch, configs, bench=None):
    """The one of `configs` whose `launch(config)` takes least GPU time (`gpu_time`), skipping those that do not fit
    (first_that_fits's errors); the last error when none fits. flm tunes the forward itself: Triton's autotuner cannot
    build a config's host-side tensor descriptors."""
    bench = bench or gpu_time
    timed, error = [], None
    for i, config in enumerate(configs):
        run = functools.partial(launch, config)
        try:
            run()  # compiles; a config that does not fit fails here
        except _UNFIT as err:
            error = err
            continue
        timed.append((bench(run), i, config))
    if not timed:
        raise error if error is not None else ValueError("no launch configuration to try")
    return min(timed)[2]


def last_choice() -> str:
    """The tuner's latest choice (the last shape it tuned), as `BLOCK_MxBLOCK_Nxwarpsxstages loads`: what a benchmark
    row ran."""
    bm, bn, warps, stages, loads = next(reversed(_TUNED.values()))
    return f"{bm}x{bn}x{warps}x{stages} {LOAD_NAMES[loads]}"


# the load kinds by their TMA value, as the benchmarks name them
LOAD_NAMES = ("pointers", "tma", "tma-host")


def gpu_time(fn) -> float:
    """Milliseconds of GPU time per call of fn, the median of replays of a CUDA graph of repeated calls (Triton's
    do_bench_cudagraph, what Triton's autotuner uses with use_cuda_graph), so a launch's host time does not count: a
    graphed step does not pay it. triton.testing.do_bench, which the tuner used first, brackets each call with events;
    where the host takes longer to launch than do_bench's cache flush runs (a 256-token launch with host-built
    descriptors costs 27-96 us more host time), the GPU's wait counted. So at 256 tokens the tuned forward ran at the
    pointer loads' speed, 1.10-1.14x below the host-built descriptors' on the GPU (H100, docs/attention.md, fifty-seventh
    day)."""
    # the timing runs on a stream of its own: the inputs must be written and the outputs' memory free of pending work
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def _capturing(x: torch.Tensor) -> bool:
    """A CUDA graph capture is under way on the current stream (asked only for CUDA inputs: torch.cuda raises on a
    machine without a driver)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def tma_wanted() -> tuple[int, ...]:
    """The load kinds FLM_ATTENTION_TMA asks the forward's tuner to try (0 pointers, 1 tensor descriptors that each
    program builds for its head, 2 descriptors of the whole tensors that the host builds per launch; Hopper's TMA):
    auto (the default) 0 and 2, timed against each other per shape; 0 (or false, off, no) pointers only; 1 (or true, on,
    yes, device) device-built only; host host-built only. Device-built descriptors are never tried by default: on an
    H200 they lost up to 0.60x at 256 tokens to each program's descriptor setup (docs/attention.md)."""
    value = os.environ.get("FLM_ATTENTION_TMA", "auto").strip().lower()
    loads = _TMA_MODES.get(value)
    if loads is None:
        raise ValueError(
            f"FLM_ATTENTION_TMA={value!r}: set auto (time pointer loads against host-built descriptors, the default), 0 "
            "(pointer loads), 1 (descriptors each program builds) or host (descriptors built on the host)"
        )
    return loads


_TMA_MODES = {
    **dict.fromkeys(("auto", ""), (0, 2)),
    **dict.fromkeys(env.OFF, (0,)),
    **dict.fromkeys((*env.ON, "device"), (1,)),
    **dict.fromkeys(("2", "host"), (2,)),
}


def _loads(tma, tensors, has_bias: bool, has_mask: bool) -> tuple[int, ...]:
    """The load kinds to try for these inputs: `tma` (attention_fwd's argument; None: FLM_ATTENTION_TMA) less the
    descriptors where they cannot read the inputs (`tma_fits`); pointers then."""
    wanted = tma_wanted() if tma is None else _TMA_MODES[str(tma).lower()]
    if wanted != (0,) and not tma_fits(tensors, has_bias, has_mask):
        return (0,)
    return wanted


def tma_fits(tensors, has_bias: bool, has_mask: bool) -> bool:
    """Tensor descriptors can read these inputs: a GPU of compute capability 9 or more (or the interpreter), no bias
    or mask (their loads stay pointers), and 16-byte aligned bases (their strides are multiples of 8 elements already,
    `_prepare`)."""
    if has_bias or has_mask:
        return False
    if not interpreted() and not hopper_or_later(tensors[0].device):
        return False
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _descriptors(x: torch.Tensor, rows: int, widths: tuple[int, int]) -> list:
    """4-D tensor descriptors of x (B, H, L, D), read in (1, 1, rows, width) blocks, one per nonzero width (the head
    dim's main chunk and its remainder). A dim of size 1 gets a stride of 16 elements: it is never stepped, and the copy
    engine wants every stride a multiple of 16 bytes. Made without TensorDescriptor's own checks (~4 us each on a slow
    CPU, and a launch makes up to twelve): `tma_fits` and `_prepare` have checked the base's alignment and the strides."""
    b, h, n, _ = shape = list(x.shape)
    sb, sh, sn, _ = x.stride()
    fields = {**_descriptor_defaults(), "base": x, "shape": shape}
    fields["strides"] = [sb if b > 1 else 16, sh if h > 1 else 16, sn if n > 1 else 16, 1]
    made = []
    for width in widths:
        if not width:
            made.append(None)
            continue
        d = object.__new__(TensorDescriptor)
        d.__dict__ = {**fields, "block_shape": [1, 1, rows, width]}
        made.append(d)
    return made


@functools.cache
def _descriptor_defaults() -> dict:
    """TensorDescriptor's fields that have defaults (padding, ...: they vary across Triton versions). Read-only."""
    return {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


def _with_descriptors(args: list, bm: int, bn: int, block_d: int, block_d_rem: int) -> list:
    """The launch's arguments with q, k, v, tq, tk, tv (args 0-5) and the remainder's slots (12-17, QR ... TVR in the
    same order) as descriptors."""
    out, made = list(args), {}
    for i, x in enumerate(args[:6]):
        rows = bm if i in (0, 3) else bn
        key = (id(x), rows)  # without tangents args 3-5 are q, k, v again: their descriptors are made once
        if key not in made:
            made[key] = _descriptors(x, rows, (block_d, block_d_rem))
        out[i], rem = made[key]
        if rem is not None:
            out[12 + i] = rem
    return out


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors the kernel makes (Triton asks at each launch that needs it)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton `_scratch` as its allocator unless the caller has set one (Triton's default refuses to allocate)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def interpreted() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1): no tuning, small blocks."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------

SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 8))


def check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"the fused Triton attention supports head dims 16..256 that are multiples of 8, got "
            f"{head_dim}; change the model's width or number of heads, or use backend='math'"
        )


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D_REM): the head dim's largest power of two and a power-of-two tile of at least
    16 (tl.dot's smallest size) for the rest, 0 when there is none. 72 -> (64, 16), 96 -> (64, 32).
    Above 128 a head dim that is not a power of two runs padded: 160 -> (256, 0) (see the module docstring)."""
    main = 1 << (head_dim.bit_length() - 1)
    if main == head_dim:
        return main, 0
    if main >= 128:
        return 256, 0
    return main, max(16, next_power_of_2(head_dim - main))


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1, in plain Python: Triton's is a constexpr function whose call costs ~2 us of
    host time (Triton 3.8, CPU), and the wrapper calls it on every launch."""
    return 1 << (n - 1).bit_length()


def _prepare(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (4 dims) in the kernel's layout: head dim zero-padded to `width` (above 128 only), unit head-dim stride and
    every other stride a multiple of 8 elements (16-byte aligned rows). Copies only when needed."""
    b, h, n, d = x.shape
    if d < width:
        return F.pad(x, (0, width - d))
    sb, sh, sn, sd = x.stride()
    if sd == 1 and (sb % 8 == 0 or b == 1) and (sh % 8 == 0 or h == 1) and (sn % 8 == 0 or n == 1):
        return x
    return x.contiguous()


def _empty_in_order(shape: tuple[int, ...], order: tuple[int, ...] | None, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `shape` laid out dense in `order` (outermost first), contiguous without one. Written
    in the DiT's (B, L, H, D) order, O reshapes for the output projection and reaches cuDNN's backward without a copy."""
    if order is None or order[-1] != len(shape) - 1:  # the kernel writes rows of unit head-dim stride
        order = tuple(range(len(shape)))
    t = torch.empty([shape[i] for i in order], dtype=like.dtype, device=like.device)
    return t.permute([order.index(i) for i in range(len(shape))])


def attention_fwd(
    q,
    k,
    v,
    tq=None,
    tk=None,
    tv=None,
    *,
    causal: bool,
    scale: float,
    config=None,
    bias=None,
    bias_tangent=None,
    key_padding_mask=None,
    tma: bool | str | None = None,
    out_order: tuple[int, ...] | None = None,
):
    """(o, to, lse) for q (B, H, Lq, D), k/v (B, H, Lkv, D); to is None without tangents.

    Inputs are assumed checked (flm.attention.inputs); lse is (B, H, Lq) fp32 in natural log.
    config = (BLOCK_M, BLOCK_N, num_warps, num_stages) skips tuning (benchmarks/attention_configs.py; with tma auto it
    reads through pointers).
    tma: how the tiles are read: False (pointer loads), True or "device" (tensor descriptors each program builds for its
    head), "host" (descriptors built here), "auto" (pointers or host-built ones, whichever the tuner times faster);
    None: FLM_ATTENTION_TMA decides (auto by default). Descriptors only where they fit (`tma_fits`).
    bias (and bias_tangent, used only with tangents): 4 dims broadcastable to (B, H, Lq, Lkv), any
    strides; key_padding_mask: bool (B, Lkv), True = attend.
    out_order: o and to dense with their dims in this order, outermost first (flm.attention.layout.q_order: SDPA's
    layout of O, (0, 2, 1, 3) for the DiT's views of one projection); None or an order without the head dim innermost:
    contiguous.
    """
    b, h, lq, d = q.shape
    lkv = k.shape[2]
    check_head_dim(d)
    has_tangent = tq is not None
    has_bias, has_mask = bias is not None, key_padding_mask is not None
    has_bias_tangent = has_tangent and bias_tangent is not None
    if lkv == 0 or lq == 0 or b * h == 0:  # nothing to attend to: O = tO = 0, lse = -inf
        o = q.new_zeros(q.shape)
        lse = torch.full((b, h, lq), float("-inf"), dtype=torch.float32, device=q.device)
        return o, torch.zeros_like(o) if has_tangent else None, lse
    block_d, block_d_rem = split_head_dim(d)
    width = max(d, block_d)  # the padded width above 128, else d
    q, k, v = (_prepare(x, width) for x in (q, k, v))
    tq, tk, tv = (_prepare(x, width) for x in (tq, tk, tv)) if has_tangent else (q, k, v)
    o = _empty_in_order((b, h, lq, width), out_order, q)
    to = torch.empty_like(o) if has_tangent else o
    lse = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    loads = _loads(tma, (q, k, v, tq, tk, tv), has_bias, has_mask)
    # broadcast dims read with stride 0; absent inputs pass q and zero strides (the kernel ignores them)
    bias = bias.expand(b, h, lq, lkv) if has_bias else q
    tbias = bias_tangent.expand(b, h, lq, lkv) if has_bias_tangent else q
    kpm = key_padding_mask.contiguous().view(torch.uint8) if has_mask else q
    args = [
        q,
        k,
        v,
        tq,
        tk,
        tv,
        o,
        to,
        lse,
        bias,
        tbias,
        kpm,
        *(q,) * 6,  # the remainder's descriptors (host-built TMA only; unused otherwise)
        *(st for x in (q, k, v, tq, tk, tv, o) for st in x.stride()[:3]),
        *(bias.stride() if has_bias else (0, 0, 0, 0)),
        *(tbias.stride() if has_bias_tangent else (0, 0, 0, 0)),
        h,
        lq,
        lkv,
        scale,
        next_power_of_2(lq),
        next_power_of_2(lkv),
    ]
    meta = dict(
        HEAD_DIM=width,
        BLOCK_D=block_d,
        BLOCK_D_REM=block_d_rem,
        HAS_TANGENT=has_tangent,
        HAS_BIAS=has_bias,
        HAS_BIAS_TANGENT=has_bias_tangent,
        HAS_MASK=has_mask,
        CAUSAL=causal,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    interpreter = interpreted()
    if interpreter:
        config = (16, 16, 4, 1)
    choice = None if config is None else (*config, loads[0])  # a given config reads through the first load kind
    tune_key = None
    if choice is None:  # the tuner's key: what the kernel specialises on, and the load kinds it may choose
        tune_key = (args[-2], args[-1], *meta.values(), loads, q.dtype, bias.dtype, tbias.dtype, q.device)
        choice = _TUNED.get(tune_key)

    def launch(choice):
        bm, bn, warps, stages, tma = choice
        grid = (-(-lq // bm), b * h)
        run_args = _with_descriptors(args, bm, bn, block_d, block_d_rem) if tma == 2 else args
        run_meta = {**meta, "TMA": tma, "BLOCK_M": bm, "BLOCK_N": bn}
        if interpreter:
            _fwd_kernel[grid](*run_args, **run_meta, num_warps=warps, num_stages=stages)
        else:
            if tma == 1:
                _ensure_allocator()
            _fwd_launch(grid, run_args, run_meta, warps, stages)

    if choice is not None:
        launch(choice)
    else:
        tried = launch_candidates(block_d + block_d_rem, has_bias or has_mask, loads)
        if _capturing(q):  # no timing (it synchronises), and no choice kept
            first_that_fits(launch, tried)  # the graph replays the first that fits; the next eager call tunes
        else:
            tune = fastest if autotuning() else first_that_fits
            _TUNED[tune_key] = choice = tune(launch, tried)
            if tune is fastest:  # the outputs of the choice itself, whatever the timing ran last
                launch(choice)
    if width != d:  # views without the padding columns
        o, to = o[..., :d], to[..., :d]
    return o, to if has_tangent else None, lse


__all__ = [
    "attention_fwd",
    "autotuning",
    "candidates",
    "check_head_dim",
    "split_head_dim",
    "interpreted",
    "tma_fits",
    "tma_wanted",
    "SUPPORTED_HEAD_DIMS",
]
