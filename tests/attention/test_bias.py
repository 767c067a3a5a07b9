"""Additive attention bias and key-padding masks: every CPU backend against float64 math attention,
math against explicit formulas, rows left with no key, the JVP paths, torch.compile and bad inputs.

triton_jvp runs in Triton's interpreter here (fp32, fp16; small shapes, block 16); bf16 at real sizes
is in test_triton_jvp_gpu.py.
"""

import pytest
import torch
from torch.autograd import forward_ad

import flm.attention as fa
from flm.attention import math as math_backend
from flm.kernels import attention_fwd as kernels
from tests.attention.reference import attention64, grads64, jvp64, randn, rel_err

CPU_BACKENDS = ["math", "sdpa", "triton_jvp"]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}

# (B, H, Lq, Lkv, D, bias shape, key-padding mask, causal): each broadcast of the bias, Lq != Lkv, lengths
# that are not block multiples; with a mask, key 0 of batch 0 is padded (a causal row 0 then has no key)
CASES = [
    (2, 2, 37, 37, 32, (1, 1, 37, 37), False, False),
    (2, 2, 37, 37, 32, (2, 1, 37, 37), True, False),
    (2, 2, 33, 33, 32, (2, 2, 33, 33), True, True),
    (2, 3, 19, 45, 48, (1, 3, 19, 45), True, False),
    (2, 1, 9, 33, 16, (2, 1, 1, 33), False, False),  # one bias per key, broadcast over the queries
    (2, 2, 23, 17, 72, None, True, False),  # a mask alone; head dim 72 (64 + a masked remainder in triton_jvp)
]
IDS = ["bias11", "biasB1+mask", "biasBH+mask+causal", "bias1H-cross+mask", "key-bias", "mask-only"]


def _inputs(b, h, lq, lkv, d, bias_shape, masked, dtype=torch.float32, seed=0):
    """q, k, v, their tangents, bias and its tangent (None without a bias shape), key-padding mask."""
    g = torch.Generator().manual_seed(seed)
    q, tq = (randn(b, h, lq, d, dtype=dtype, generator=g) for _ in range(2))
    k, v, tk, tv = (randn(b, h, lkv, d, dtype=dtype, generator=g) for _ in range(4))
    bias, tbias = (None, None) if bias_shape is None else (randn(*bias_shape, dtype=dtype, generator=g) for _ in range(2))
    mask = None
    if masked:
        mask = torch.rand(b, lkv, generator=g) > 0.3  # True = attend
        mask[0, 0] = False
    return q, k, v, tq, tk, tv, bias, tbias, mask


def _requires_grad(*xs):
    return [None if x is None else x.requires_grad_() for x in xs]


# ---------------------------------------------------------------------------------------------
# What bias and mask mean: math against explicit formulas, every backend against math
# ---------------------------------------------------------------------------------------------


def test_math_adds_the_bias_to_the_scaled_logits():
    q, k, v, _, _, _, bias, _, _ = _inputs(2, 3, 11, 13, 16, (2, 3, 11, 13), False, dtype=torch.float64)
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.3 + bias, dim=-1) @ v
    torch.testing.assert_close(math_backend.attention(q, k, v, causal=False, scale=0.3, bias=bias), ref)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_key_padding_mask_true_means_attend(backend):
    """A masked call equals attention over the kept keys alone, batch element by batch element."""
    q, k, v, _, _, _, bias, _, mask = _inputs(2, 2, 19, 21, 32, (1, 2, 19, 21), True)
    o = fa.attention(q, k, v, backend=backend, bias=bias, key_padding_mask=mask)
    for i in range(2):
        kept = mask[i].nonzero().squeeze(1)
        ref = attention64(q[i : i + 1], k[i : i + 1, :, kept], v[i : i + 1, :, kept], bias=bias[..., kept])
        assert rel_err(o[i : i + 1], ref) < 1e-5


@pytest.mark.parametrize(
    "backend, dtype",
    [("math", torch.float32), ("sdpa", torch.float32), ("triton_jvp", torch.float32), ("triton_jvp", torch.float16)],
)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_gradients_match_math(case, backend, dtype):
    *dims, bias_shape, masked, causal = case
    q, k, v, _, _, _, bias, _, mask = _inputs(*dims, bias_shape, masked, dtype)
    q, k, v, bias = _requires_grad(q, k, v, bias)
    o = fa.attention(q, k, v, backend=backend, causal=causal, bias=bias, key_padding_mask=mask)
    assert o.dtype == dtype
    assert rel_err(o, attention64(q, k, v, causal=causal, bias=bias, key_padding_mask=mask)) < TOL[dtype]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    o.backward(do)
    got = (q.grad, k.grad, v.grad) if bias is None else (q.grad, k.grad, v.grad, bias.grad)
    ref = grads64(q, k, v, do, causal=causal, bias=bias, key_padding_mask=mask)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        assert g.shape == r.shape and g.dtype == dtype, name
        assert rel_err(g, r) < TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_jvp_with_bias_tangent_matches_torch_func_jvp_over_math(case, dtype):
    """d(logits) = scale * (tq k^T + q tk^T) + bias_tangent, from one fused pass."""
    *dims, bias_shape, masked, causal = case
    q, k, v, tq, tk, tv, bias, tbias, mask = _inputs(*dims, bias_shape, masked, dtype, seed=2)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, causal=causal, bias=bias, bias_tangent=tbias, key_padding_mask=mask)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal, bias=bias, tbias=tbias, key_padding_mask=mask)
    assert o.dtype == dtype and to.dtype == dtype
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(to, to_ref) < TOL[dtype]


def test_fused_jvp_bias_without_tangent_is_a_constant():
    q, k, v, tq, tk, tv, bias, _, mask = _inputs(2, 2, 21, 30, 32, (2, 1, 21, 30), True, seed=3)
    _, to = fa.jvp_attention(q, k, v, tq, tk, tv, bias=bias, key_padding_mask=mask)
    _, to_ref = jvp64(q, k, v, tq, tk, tv, bias=bias, key_padding_mask=mask)
    assert rel_err(to, to_ref) < 1e-5


def test_strided_bias_view():
    """A transposed (non-contiguous) bias is read through its strides."""
    q, k, v, *_ = _inputs(1, 2, 20, 27, 32, None, False, seed=4)
    bias = torch.randn(1, 2, 27, 20).transpose(-1, -2).requires_grad_()
    q.requires_grad_()
    o = fa.attention(q, k, v, backend="triton_jvp", bias=bias)
    assert rel_err(o, attention64(q, k, v, bias=bias)) < 1e-5
    do = torch.randn_like(o)
    o.backward(do)
    dq, _, _, dbias = grads64(q, k, v, do, bias=bias)
    assert rel_err(q.grad, dq) < 1e-5 and rel_err(bias.grad, dbias) < 1e-5


# ---------------------------------------------------------------------------------------------
# Rows with no key: output 0, tangent 0, finite gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rows_with_no_key_give_zeros_not_nan(backend):
    """Batch 1 pads every key; in batch 0 query row 3 has a bias of -inf on every key."""
    q, k, v, tq, tk, tv, _, _, mask = _inputs(2, 2, 18, 20, 32, None, True, seed=5)
    mask[1] = False
    bias = torch.randn(2, 1, 18, 20)
    bias[0, :, 3] = float("-inf")
    q, k, v, bias = _requires_grad(q, k, v, bias)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv))]
        out = forward_ad.unpack_dual(fa.attention(*duals, backend=backend, bias=bias, key_padding_mask=mask))
        o, to = out.primal, out.tangent
        do = torch.randn_like(o)
        o.backward(do)
    for x in (o, to):
        assert torch.isfinite(x).all()
        assert torch.equal(x[1], torch.zeros_like(x[1])) and torch.equal(x[0, :, 3], torch.zeros_like(x[0, :, 3]))
    assert rel_err(o, attention64(q, k, v, bias=bias, key_padding_mask=mask)) < 1e-5
    assert rel_err(to, jvp64(q, k, v, tq, tk, tv, bias=bias, key_padding_mask=mask)[1]) < 1e-5
    for g, r in zip((q.grad, k.grad, v.grad, bias.grad), grads64(q, k, v, do, bias=bias, key_padding_mask=mask)):
        assert torch.isfinite(g).all() and torch.isfinite(r).all()
        assert rel_err(g, r) < 1e-5
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1])) and torch.equal(bias.grad[0, :, 3], torch.zeros(1, 20))


# ---------------------------------------------------------------------------------------------
# JVP paths: dual tensors (a dual bias carries the bias tangent), torch.func.jvp, the direct call
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dual_bias_and_torch_func_jvp_match_math(backend):
    q, k, v, tq, tk, tv, bias, tbias, mask = _inputs(2, 2, 19, 27, 32, (1, 2, 19, 27), True, seed=6)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, bias=bias, tbias=tbias, key_padding_mask=mask)
    f = lambda a, b, c, d: fa.attention(a, b, c, backend=backend, bias=d, key_padding_mask=mask)  # noqa: E731
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v, bias), (tq, tk, tv, tbias))]
        out = forward_ad.unpack_dual(f(*duals))
        bias_only = forward_ad.unpack_dual(f(q, k, v, forward_ad.make_dual(bias, tbias))).tangent
    o_func, to_func = torch.func.jvp(f, (q, k, v, bias), (tq, tk, tv, tbias))
    zeros = [torch.zeros_like(x) for x in (q, k, v)]
    _, to_bias_ref = jvp64(q, k, v, *zeros, bias=bias, tbias=tbias, key_padding_mask=mask)
    for got, ref in ((out.primal, o_ref), (out.tangent, to_ref), (o_func, o_ref), (to_func, to_ref), (bias_only, to_bias_ref)):
        assert rel_err(got, ref) < 1e-5


def test_triton_jvp_paths_equal_the_direct_call():
    q, k, v, tq, tk, tv, bias, tbias, mask = _inputs(2, 2, 29, 29, 32, (2, 1, 29, 29), True, seed=7)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, scale=0.3, bias=bias, bias_tangent=tbias, key_padding_mask=mask)
    f = lambda a, b, c, d: fa.attention(a, b, c, backend="triton_jvp", scale=0.3, bias=d, key_padding_mask=mask)  # noqa: E731
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v, bias), (tq, tk, tv, tbias))]
        out = forward_ad.unpack_dual(f(*duals))
    o_func, to_func = torch.func.jvp(f, (q, k, v, bias), (tq, tk, tv, tbias))
    for got, ref in ((out.primal, o), (out.tangent, to), (o_func, o), (to_func, to)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_dual_path_gradient_reaches_the_bias_not_the_tangent():
    q, k, v, tq, tk, tv, bias, tbias, mask = _inputs(2, 2, 21, 21, 32, (1, 2, 21, 21), True, seed=8)
    q, k, v, bias, tbias = _requires_grad(q, k, v, bias, tbias)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v, bias), (tq, tk, tv, tbias))]
        out = forward_ad.unpack_dual(fa.attention(*duals[:3], backend="triton_jvp", bias=duals[3], key_padding_mask=mask))
        assert out.tangent.grad_fn is None and not out.tangent.requires_grad
        do = torch.randn_like(out.primal)
        out.primal.backward(do)
    for g, r in zip((q.grad, k.grad, v.grad, bias.grad), grads64(q, k, v, do, bias=bias, key_padding_mask=mask)):
        assert rel_err(g, r) < 1e-5
    assert tbias.grad is None


def test_auto_takes_a_bias_and_a_mask_on_cpu():
    q, k, v, tq, tk, tv, bias, tbias, mask = _inputs(2, 2, 13, 13, 32, (1, 1, 13, 13), True, seed=9)
    assert (
        rel_err(fa.attention(q, k, v, bias=bias, key_padding_mask=mask), attention64(q, k, v, bias=bias, key_padding_mask=mask))
        < 1e-5
    )
    f = lambda a, b, c, d: fa.attention(a, b, c, bias=d, key_padding_mask=mask)  # noqa: E731
    _, to = torch.func.jvp(f, (q, k, v, bias), (tq, tk, tv, tbias))
    assert rel_err(to, jvp64(q, k, v, tq, tk, tv, bias=bias, tbias=tbias, key_padding_mask=mask)[1]) < 1e-5


def test_compiles_with_bias_and_mask_without_graph_breaks():
    torch._dynamo.reset()
    q, k, v, _, _, _, bias, _, mask = _inputs(2, 2, 16, 16, 32, (1, 2, 16, 16), True, seed=10)
    w = torch.randn(32, 32, requires_grad=True)
    bias.requires_grad_()

    def step(q, k, v, bias, mask):
        return fa.attention(q @ w, k, v, backend="triton_jvp", bias=bias, key_padding_mask=mask).square().sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, bias, mask).backward()
    grads = [w.grad.clone(), bias.grad.clone()]
    w.grad = bias.grad = None
    step(q, k, v, bias, mask).backward()
    torch.testing.assert_close(grads[0], w.grad)
    torch.testing.assert_close(grads[1], bias.grad)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


def _ok():  # q (2, 2, 8, 32); k, v (2, 2, 6, 32)
    q, k, v, *_ = _inputs(2, 2, 8, 6, 32, None, False)
    return q, k, v


@pytest.mark.parametrize(
    "bias, mask, match",
    [
        (
            torch.zeros(2, 2, 8, 5),
            None,
            r"bias has shape \(2, 2, 8, 5\), which does not broadcast to the logits .* \(2, 2, 8, 6\)",
        ),
        (torch.zeros(3, 1, 8, 6), None, r"bias has shape \(3, 1, 8, 6\), which does not broadcast"),
        (torch.zeros(1, 2, 2, 8, 6), None, r"bias has shape \(1, 2, 2, 8, 6\), which does not broadcast"),
        (torch.zeros(2, 2, 6, 8), None, r"bias has shape \(2, 2, 6, 8\).*\(B or 1, H or 1, Lq or 1, Lkv or 1\)"),
        (torch.zeros(8, 6, dtype=torch.float64), None, r"bias has dtype torch.float64, expected torch.float32"),
        (torch.zeros(8, 6, dtype=torch.bool), None, r"bias has dtype torch.bool"),
        (torch.zeros(8, 6, device="meta"), None, r"bias is on meta, expected cpu"),
        (None, torch.ones(2, 8, dtype=torch.bool), r"key_padding_mask has shape \(2, 8\), expected \(B, Lkv\) = \(2, 6\)"),
        (None, torch.ones(2, 1, 6, dtype=torch.bool), r"key_padding_mask has shape \(2, 1, 6\), expected \(B, Lkv\)"),
        (None, torch.ones(2, 6), r"key_padding_mask has dtype torch.float32, expected torch.bool \(True = attend"),
        (None, torch.ones(2, 6, dtype=torch.int64), r"key_padding_mask has dtype torch.int64, expected torch.bool"),
        (None, torch.ones(2, 6, dtype=torch.bool, device="meta"), r"key_padding_mask is on meta, expected cpu"),
    ],
)
def test_bad_bias_or_mask_is_named(bias, mask, match):
    q, k, v = _ok()
    for backend in CPU_BACKENDS:
        with pytest.raises(ValueError, match=match):
            fa.attention(q, k, v, backend=backend, bias=bias, key_padding_mask=mask)
    with pytest.raises(ValueError, match=match):
        fa.jvp_attention(q, k, v, q, k, v, bias=bias, key_padding_mask=mask)


def test_fp16_bias_for_fp32_inputs_is_refused_but_fp32_bias_for_fp16_inputs_runs():
    q, k, v = _ok()
    with pytest.raises(
        ValueError, match=r"bias has dtype torch.float16, expected torch.float32 \(the dtype of q\) or torch.float32"
    ):
        fa.attention(q, k, v, bias=torch.zeros(8, 6, dtype=torch.float16))
    bias = torch.randn(8, 6)
    o = fa.attention(q.half(), k.half(), v.half(), backend="triton_jvp", bias=bias)
    assert rel_err(o, attention64(q.half(), k.half(), v.half(), bias=bias)) < TOL[torch.float16]


@pytest.mark.parametrize(
    "bias, tbias, match",
    [
        (torch.zeros(1, 1, 8, 6), torch.zeros(2, 1, 8, 6), r"bias_tangent has shape \(2, 1, 8, 6\), expected \(1, 1, 8, 6\)"),
        (
            torch.zeros(8, 6),
            torch.zeros(8, 6, dtype=torch.float16),
            r"bias_tangent has dtype torch.float16, expected torch.float32",
        ),
        (None, torch.zeros(8, 6), r"bias_tangent was given without a bias"),
    ],
)
def test_bad_bias_tangent_is_named(bias, tbias, match):
    q, k, v = _ok()
    with pytest.raises(ValueError, match=match):
        fa.jvp_attention(q, k, v, q, k, v, bias=bias, bias_tangent=tbias)


def test_flash_refuses_a_bias_or_mask_and_names_the_alternatives(monkeypatch):
    monkeypatch.setattr(fa.flash, "check_available", lambda *args: None)  # pretend we are on a GPU
    q, k, v = _ok()
    for kw in (dict(bias=torch.zeros(8, 6)), dict(key_padding_mask=torch.ones(2, 6, dtype=torch.bool))):
        with pytest.raises(
            ValueError, match="'flash' takes no bias or key_padding_mask; use backend='sdpa', 'triton_jvp' or 'math'"
        ):
            fa.attention(q, k, v, backend="flash", **kw)


def test_bias_path_adds_a_launch_fallback_and_leaves_the_plain_candidates_alone():
    """The no-bias kernel keeps its tuned candidates; the bias path also tries one that fits shared memory (and only
    pointer loads: descriptors never read a bias or mask, `tma_fits`)."""
    # head dim -> its tile width's list: powers of two as before the split, the split widths their own
    for d, width in ((32, 64), (64, 64), (128, 128), (256, 256), (40, 64), (72, 80), (96, 96), (112, 128), (160, 256)):
        block_d, block_d_rem = kernels.split_head_dim(d)
        plain = kernels.launch_candidates(block_d + block_d_rem, False, (0,))
        assert plain == [(*c, 0) for c in kernels._CANDIDATES[width]]
        assert kernels.launch_candidates(block_d + block_d_rem, True, (0,)) == [*plain, (*kernels._BIAS_FALLBACK, 0)]
