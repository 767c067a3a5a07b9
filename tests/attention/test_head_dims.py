"""Head dims that are not a power of two in the fused kernel: a power-of-two chunk plus a masked
remainder tile, read in place, against float64 math attention (tangents, causal, bias, mask, strided
views), and no padded copies.

On the CPU these run in Triton's interpreter (fp32, fp16, block 16); bf16 at real sizes is in
test_triton_jvp_gpu.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

import flm.attention as fa
from flm.kernels import attention_fwd as kernels
from tests.attention.reference import grads64, jvp64, qkv_and_tangents, randn, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.fixture
def no_padding(monkeypatch):
    """Fails the test if the wrapper pads or copies an input: every input must reach the kernel as is."""
    prepare = kernels._prepare

    def checked(x, width):
        y = prepare(x, width)
        assert y is x, f"the wrapper copied an input of shape {tuple(x.shape)} and strides {x.stride()}"
        return y

    def refuse(*args, **kwargs):
        raise AssertionError("F.pad called")

    monkeypatch.setattr(kernels, "_prepare", checked)
    monkeypatch.setattr(F, "pad", refuse)


def _assert_unpadded(x, d):
    """x is a (B, H, L, d) tensor of its own, dense at width d in q's order, its storage no larger than itself."""
    assert x.shape[-1] == d and (x.is_contiguous() or x.transpose(1, 2).is_contiguous())  # q's order: (B, H, L) or (B, L, H)
    assert x.untyped_storage().nbytes() == x.numel() * x.element_size()


@pytest.mark.parametrize(
    "d, split",
    [(16, (16, 0)), (24, (16, 16)), (40, (32, 16)), (48, (32, 16)), (64, (64, 0)), (72, (64, 16)), (80, (64, 16))]
    + [(96, (64, 32)), (112, (64, 64)), (128, (128, 0)), (160, (256, 0)), (192, (256, 0)), (256, (256, 0))],
)
def test_split_head_dim(d, split):
    assert kernels.split_head_dim(d) == split


def test_every_supported_head_dim_splits_into_power_of_two_tiles_that_cover_it():
    for d in kernels.SUPPORTED_HEAD_DIMS:
        main, rem = kernels.split_head_dim(d)
        assert main & (main - 1) == 0
        if main >= d:  # a power of two, or padded to 256 above 128
            assert rem == 0 and (main == d or d > 128)
        else:  # the remainder tile: a power of two, at least 16, wide enough and not wider than the main chunk
            assert rem & (rem - 1) == 0 and 16 <= rem <= main and main + rem >= d


# (B, H, Lq, Lkv, D, causal): a remainder of 8 loaded as a masked 16 (24, 40, 72), an exact power-of-two
# remainder (80, 96), ragged lengths and cross-attention
SHAPES = [
    (1, 2, 37, 29, 24, False),
    (2, 1, 21, 21, 40, True),
    (1, 2, 37, 37, 72, True),
    (2, 1, 19, 45, 80, False),
    (1, 1, 33, 33, 96, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"d{s[4]}" + ("-causal" if s[5] else "") for s in SHAPES])
def test_split_jvp_and_forward_match_math(shape, dtype, no_padding):
    *dims, causal = shape
    q, k, v, tq, tk, tv = qkv_and_tangents(*dims, dtype)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, causal=causal)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal)
    for x in (o, to):
        assert x.dtype == dtype
        _assert_unpadded(x, dims[-1])
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(to, to_ref) < TOL[dtype]
    o_plain = fa.attention(q, k, v, backend="triton_jvp", causal=causal)  # the kernel without tangents
    _assert_unpadded(o_plain, dims[-1])
    assert rel_err(o_plain, o_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d", [40, 72, 96])
def test_split_with_bias_tangent_and_mask_matches_math(d, dtype, no_padding):
    """A per-head bias with its tangent and a key-padding mask; batch 1 pads every key (its rows get 0)."""
    q, k, v, tq, tk, tv = qkv_and_tangents(2, 2, 23, 30, d, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    bias, tbias = (randn(1, 2, 23, 30, dtype=dtype, generator=g) for _ in range(2))
    mask = torch.rand(2, 30, generator=g) > 0.3
    mask[1] = False
    kw = dict(bias=bias, key_padding_mask=mask)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, bias_tangent=tbias, **kw)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, tbias=tbias, **kw)
    assert rel_err(o, o_ref) < TOL[dtype] and rel_err(to, to_ref) < TOL[dtype]
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.equal(to[1], torch.zeros_like(to[1]))
    assert rel_err(fa.attention(q, k, v, backend="triton_jvp", **kw), o_ref) < TOL[dtype]


def test_split_gradients_with_bias_match_math():
    """The backward (flm's Triton one, with a bias) at head dim 72 from the unpadded forward's o."""
    q, k, v, *_ = qkv_and_tangents(1, 2, 21, 26, 72, seed=3)
    bias = torch.randn(1, 1, 21, 26)
    q, k, v, bias = (x.requires_grad_() for x in (q, k, v, bias))
    o = fa.attention(q, k, v, backend="triton_jvp", bias=bias)
    do = torch.randn_like(o)
    o.backward(do)
    for x, ref in zip((q, k, v, bias), grads64(q, k, v, do, bias=bias)):
        assert rel_err(x.grad, ref) < 1e-5


@pytest.mark.parametrize("d", [136, 160])
def test_head_dims_above_128_run_padded_and_match_math(d):
    """Above 128 a head dim that is not a power of two runs the 256-wide kernel on zero-padded copies; the
    outputs are views of width d."""
    q, k, v, tq, tk, tv = qkv_and_tangents(1, 2, 19, 23, d, seed=4)
    o, to = fa.jvp_attention(q, k, v, tq, tk, tv, causal=False)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    assert o.shape == q.shape and rel_err(o, o_ref) < 1e-5 and rel_err(to, to_ref) < 1e-5


def test_split_reads_views_of_a_fused_qkv_in_place(no_padding):
    """q, k, v as strided views of one (B, N, 3, H, 72) projection, tangents in another layout: no copies."""
    b, n, h, d = 2, 27, 2, 72
    qkv = torch.randn(b, n, 3, h, d)
    tqkv = torch.randn(b, 3, h, n, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) views, not contiguous
    tq, tk, tv = tqkv.unbind(1)
    assert not q.is_contiguous()
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv))]
        out = forward_ad.unpack_dual(fa.attention(*duals, backend="triton_jvp"))
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    assert rel_err(out.primal, o_ref) < 1e-5 and rel_err(out.tangent, to_ref) < 1e-5
    _assert_unpadded(out.primal, d)
