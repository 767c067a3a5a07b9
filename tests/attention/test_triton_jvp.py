"""The fused JVP kernel and its Triton backward against float64 math attention.

On the CPU these run in Triton's interpreter (fp32, fp16, small shapes); bf16 is covered by the
gpu tests (the interpreter's bf16 dot is broken).
"""

import pytest
import torch
from torch.autograd import forward_ad

from flm.attention import attention, jvp_attention
from flm.attention import triton_jvp
from tests.attention.reference import grads64, jvp64, qkv_and_tangents, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}

# (B, H, Lq, Lkv, D, causal): ragged lengths, cross-attention, head dims 32 / 48 / 72, causal
SHAPES = [
    (2, 2, 37, 37, 32, False),
    (1, 2, 33, 65, 48, False),
    (1, 1, 40, 40, 72, True),
    (2, 1, 50, 9, 72, False),
    (1, 2, 1, 23, 16, False),
    (1, 1, 31, 31, 32, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_jvp_matches_torch_func_jvp_over_math(shape, dtype):
    *dims, causal = shape
    q, k, v, tq, tk, tv = qkv_and_tangents(*dims, dtype)
    o, to = jvp_attention(q, k, v, tq, tk, tv, causal=causal)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal)
    assert o.dtype == dtype and to.dtype == dtype
    assert rel_err(o, o_ref) < TOL[dtype]
    assert rel_err(to, to_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_backward_matches_autograd_over_math(shape, dtype):
    *dims, causal = shape
    q, k, v, *_ = qkv_and_tangents(*dims, dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    assert triton_jvp.backward_impl(q) == "triton"  # what runs on the CPU
    o = attention(q, k, v, backend="triton_jvp", causal=causal)
    do = torch.randn_like(o)
    o.backward(do)
    for got, ref in zip((q.grad, k.grad, v.grad), grads64(q, k, v, do, causal=causal)):
        assert rel_err(got, ref) < TOL[dtype]


def test_dual_and_func_jvp_paths_equal_direct_call():
    q, k, v, tq, tk, tv = qkv_and_tangents(2, 2, 29, 29, 32, torch.float32, seed=1)
    o, to = jvp_attention(q, k, v, tq, tk, tv, scale=0.3)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv))]
        out = forward_ad.unpack_dual(attention(*duals, backend="triton_jvp", scale=0.3))
    f = lambda a, b, c: attention(a, b, c, backend="triton_jvp", scale=0.3)  # noqa: E731
    o_func, to_func = torch.func.jvp(f, (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(out.primal, o, rtol=0, atol=0)
    torch.testing.assert_close(out.tangent, to, rtol=0, atol=0)
    torch.testing.assert_close(o_func, o, rtol=0, atol=0)
    torch.testing.assert_close(to_func, to, rtol=0, atol=0)


def test_dual_path_gradient_flows_to_primals_not_tangent():
    q, k, v, tq, tk, tv = qkv_and_tangents(1, 2, 21, 21, 32, torch.float32, seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    tq.requires_grad_()  # a tangent with a graph must not leak into the tangent output
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv))]
        out = forward_ad.unpack_dual(attention(*duals, backend="triton_jvp"))
        assert out.tangent.grad_fn is None and not out.tangent.requires_grad
        do = torch.randn_like(out.primal)
        out.primal.backward(do)
    for got, ref in zip((q.grad, k.grad, v.grad), grads64(q, k, v, do)):
        assert rel_err(got, ref) < 1e-5
    assert tq.grad is None


def test_partial_tangents_get_zeros():
    """Keys and values with no tangent (a t-independent context) count as zero tangents."""
    q, k, v, tq, _, _ = qkv_and_tangents(1, 2, 17, 11, 32, torch.float32, seed=3)
    with forward_ad.dual_level():
        out = forward_ad.unpack_dual(attention(forward_ad.make_dual(q, tq), k, v, backend="triton_jvp"))
    _, to_ref = jvp64(q, k, v, tq, torch.zeros_like(k), torch.zeros_like(v))
    assert rel_err(out.tangent, to_ref) < 1e-5


def test_non_contiguous_views_of_fusedqkv_and_tangents():
    b, n, h, d = 2, 19, 2, 40
    qkv = torch.randn(b, n, 3, h, d)
    tqkv = torch.randn(b, 3, h, n, d)  # a different layout from the primal's
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, D) views, not contiguous
    tq, tk, tv = tqkv.unbind(1)
    assert not q.is_contiguous()
    o, to = jvp_attention(q, k, v, tq, tk, tv)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(to, to_ref) < 1e-5
    # O and its tangent come in q's (B, N, H, D) order, as SDPA's do: the DiT's (B, N, H * D) reshape for the output
    # projection is a view, and cuDNN's backward takes O without a copy
    for x in (o, to, attention(q, k, v, backend="triton_jvp")):
        assert x.transpose(1, 2).is_contiguous()
        assert x.transpose(1, 2).reshape(b, n, h * d).data_ptr() == x.data_ptr()


def test_no_keys_gives_zeros_not_nan():
    q, tq = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32)
    k = torch.randn(1, 2, 0, 32, requires_grad=True)
    v = torch.randn(1, 2, 0, 32, requires_grad=True)
    q.requires_grad_()
    o, to = jvp_attention(q, k, v, tq, torch.zeros_like(k), torch.zeros_like(v))
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(to, torch.zeros_like(to))
    o.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_plain_forward_matches_math():
    q, k, v, *_ = qkv_and_tangents(2, 2, 45, 30, 72, torch.float32, seed=4)
    o = attention(q, k, v, backend="triton_jvp")
    assert rel_err(o, jvp64(q, k, v, q, k, v)[0]) < 1e-5


def test_compiles_without_graph_breaks():
    """Custom ops keep torch.compile's graph whole on the plain forward and backward."""
    torch._dynamo.reset()
    q, k, v, *_ = qkv_and_tangents(1, 2, 16, 16, 32, torch.float32, seed=5)
    w = torch.randn(32, 32, requires_grad=True)

    def step(q, k, v):
        return attention(q @ w, k, v, backend="triton_jvp").square().sum()

    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
    loss.backward()
    w_grad, w.grad = w.grad.clone(), None
    step(q, k, v).backward()
    torch.testing.assert_close(w_grad, w.grad)


@pytest.mark.parametrize("d", [32, 160])  # 160: the kernel pads it to 256, eager mode keeps views without the padding
def test_a_compiled_jvp_takes_the_fused_kernel(monkeypatch, d):
    """torch.func.jvp under torch.compile (trainer.compile's path): one fused launch gives o and its tangent, and the
    loss and gradients match eager mode; the fused op's autograd formula gives o's gradient in compiled code."""
    torch._dynamo.reset()
    q, k, v, tq, tk, tv = qkv_and_tangents(1, 2, 16, 16, d, torch.float32, seed=6)
    for x in (q, k, v):
        x.requires_grad_(True)
    w = torch.randn(d, d, requires_grad=True)

    def step(q, k, v):
        f = lambda q, k, v: attention(q @ w, k, v, backend="triton_jvp")  # noqa: E731
        o, to = torch.func.jvp(f, (q, k, v), (tq, tk, tv))
        return o.square().sum() + (o * to.detach()).sum()

    launches = []
    fused = triton_jvp.attention_fwd
    monkeypatch.setattr(triton_jvp, "attention_fwd", lambda *a, **kw: launches.append(len(a)) or fused(*a, **kw))
    loss = torch.compile(step)(q, k, v)
    loss.backward()
    assert launches == [6]  # q, k, v and their tangents: the fused JVP kernel, no separate plain forward
    compiled = [x.grad.clone() for x in (q, k, v, w)]
    for x in (q, k, v, w):
        x.grad = None
    eager = step(q, k, v)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    for got, want in zip(compiled, (q.grad, k.grad, v.grad, w.grad)):
        torch.testing.assert_close(got, want)


def test_a_backward_traced_under_fake_tensors_takes_the_custom_op():
    """AOTAutograd traces the fused op's registered backward under fake tensors, where torch 2.11's is_compiling() is
    False (a compiled sCD loss failed on an H100): the backward must go through the opaque custom op there, not launch
    Triton on a fake tensor; in eager mode it calls the Python body."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert triton_jvp._op("op", "body") == "body"
    with FakeTensorMode():
        assert triton_jvp._op("op", "body") == "op"


def _fake_flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    """flash_attn 2.7's private backward (same signature, (B, N, H, D) layout), computed the way it
    does: P from the saved natural-log lse, dS = P * (dP - rowsum(dO * O))."""
    assert q.shape[1:] == out.shape[1:] and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert dropout_p == 0.0 and window_size_left == window_size_right == -1 and not deterministic
    q, k, v, o, do = (x.transpose(1, 2).double() for x in (q, k, v, out, dout))  # (B, H, N, D)
    s = softmax_scale * q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - softmax_lse.double()[..., None])
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    for buf, g in ((dq, softmax_scale * ds @ k), (dk, softmax_scale * ds.transpose(-1, -2) @ q), (dv, p.transpose(-1, -2) @ do)):
        buf.copy_(g.transpose(1, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_backward_call_matches_autograd_over_math(causal):
    """flm's call into flash_attn's backward (layout, lse, keyword names), against a stand-in with
    flash_attn 2.7's signature: flash_attn itself needs a CUDA build."""
    q, k, v, *_ = qkv_and_tangents(2, 3, 29, 29, 32, torch.float32)
    o, _, lse = triton_jvp.attention_fwd(q, k, v, causal=causal, scale=32**-0.5)
    do = torch.randn_like(o)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_jvp, "_flash_attn_backward", lambda: _fake_flash_attn_backward)
        got = triton_jvp.flash_attn_bwd(do, q, k, v, o, lse, causal, 32**-0.5)
    for g, ref in zip(got, grads64(q, k, v, do, causal=causal)):
        assert g.shape == ref.shape and rel_err(g, ref) < 1e-5
