"""cuDNN's attention backward fed with flm's O and lse (triton_jvp.torch_cudnn_bwd) against PyTorch's
FlashAttention-2 backward and float64 math, the statistics format against cuDNN's own forward, and the
fused attention's gradient end to end with FLM_ATTN_BACKWARD=cudnn.

Run on a CUDA machine: pytest -m gpu tests/attention
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flm.attention as fa
from flm.attention import triton_jvp
from tests.attention.reference import grads64, rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # against float64, as in test_triton_jvp_gpu.py
GRID = [(d, n, causal) for d in (64, 128) for n in (256, 1024) for causal in (False, True)]


def _skip_without_cudnn(dtype, head_dim):
    problem = triton_jvp.cudnn_unsupported(torch.device("cuda"), dtype, head_dim)
    if problem:
        pytest.skip(f"cuDNN's attention backward {problem}")


def _inputs(b, h, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(b, h, n, d, device="cuda", generator=g).to(dtype) for _ in range(4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, n, causal", GRID)
def test_cudnn_backward_matches_fa2_and_math(d, n, causal, dtype):
    _skip_without_cudnn(dtype, d)
    q, k, v, do = _inputs(1, 2, n, d, dtype)
    scale = d**-0.5
    o, lse = torch.ops.flm.attention_fwd(q, k, v, causal, scale)
    got = triton_jvp.torch_cudnn_bwd(do, q, k, v, o, lse, causal, scale)
    fa2 = triton_jvp.torch_fa2_bwd(do, q, k, v, o, lse, causal, scale)
    for g, f, ref in zip(got, fa2, grads64(q, k, v, do, causal=causal)):
        assert g.shape == ref.shape and g.dtype == dtype
        assert rel_err(g, ref) < TOL[dtype]
        assert rel_err(g, f) < TOL[dtype]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_cudnn_forward_statistics_are_what_flm_feeds(d, causal):
    """cuDNN's own forward returns the statistics its backward reads: the same shape, dtype and numbers as
    flm's lse in the form torch_cudnn_bwd passes it (natural log, (B, H, Lq, 1)); log2 would differ by 44 %."""
    _skip_without_cudnn(torch.bfloat16, d)
    q, k, v, _ = _inputs(2, 3, 1000, d, torch.bfloat16)
    scale = d**-0.5
    o_cudnn, lse_cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[
        :2
    ]
    o, lse = torch.ops.flm.attention_fwd(q, k, v, causal, scale)
    fed = lse.unsqueeze(-1)
    assert lse_cudnn.dtype == fed.dtype == torch.float32
    assert lse_cudnn.shape == fed.shape == (2, 3, 1000, 1)
    torch.testing.assert_close(lse_cudnn, fed, rtol=0, atol=1e-2)
    assert rel_err(o, o_cudnn) < TOL[torch.bfloat16]


def test_cudnn_backward_takes_views_and_padded_head_dims():
    """q, k, v as views of a fused (B, N, 3, H, D) projection, head dim 72, dO in another layout than O."""
    _skip_without_cudnn(torch.bfloat16, 72)
    b, n, h, d = 2, 333, 4, 72
    qkv = torch.randn(b, n, 3, h, d, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    do = torch.randn(b, n, h, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    o, lse = torch.ops.flm.attention_fwd(q, k, v, False, d**-0.5)
    assert o.stride() != do.stride()
    got = triton_jvp.torch_cudnn_bwd(do, q, k, v, o, lse, False, d**-0.5)
    for g, ref in zip(got, grads64(q, k, v, do)):
        assert rel_err(g, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("q_layout", ["contiguous", "fused qkv"])
def test_cudnn_backward_takes_o_in_either_layout_in_one_process(q_layout):
    """O and dO contiguous, then in (B, N, H, D) storage, at the same shapes and q, one after the other on one thread
    (PyTorch's cache of cuDNN graphs is per thread: the autograd engine's, in training): the gradients of both match
    float64. On the fifty-first day's H200 an O in (B, N, H, D) storage beside a contiguous q, after a contiguous O at the
    same shapes, gave gradients 20x off."""
    _skip_without_cudnn(torch.bfloat16, 64)
    b, n, h, d = 2, 512, 4, 64
    if q_layout == "contiguous":
        q, k, v, _ = _inputs(b, h, n, d, torch.bfloat16, seed=3)
    else:
        q, k, v = torch.randn(b, n, 3, h, d, device="cuda").to(torch.bfloat16).permute(2, 0, 3, 1, 4)
    g = torch.randn(b, n, h, d, device="cuda").to(torch.bfloat16)
    ref = grads64(q, k, v, g.transpose(1, 2))
    for layout in ("contiguous", "bnhd", "contiguous"):
        o, lse = torch.ops.flm.attention_fwd(q, k, v, False, d**-0.5)
        do = g.transpose(1, 2)
        if layout == "contiguous":
            do = do.contiguous()
        else:
            o = o.transpose(1, 2).contiguous().transpose(1, 2)
        got = triton_jvp.torch_cudnn_bwd(do, q, k, v, o, lse, False, d**-0.5)
        for x, r in zip(got, ref):
            assert rel_err(x, r) < TOL[torch.bfloat16], layout


def test_eager_fused_attention_gradient_with_heads_merged_matches_math():
    """The DiT's use, eager: q, k, v views of one projection, O merged into (B, N, H * D) after attention, the gradient
    coming back through the merge. Against math attention in float32 on the same bf16-rounded input."""
    _skip_without_cudnn(torch.bfloat16, 64)
    b, n, h, d = 2, 256, 6, 64
    x = torch.randn(b, n, 3 * h * d, device="cuda")
    w = torch.randn(h * d, h * d, device="cuda") / (h * d) ** 0.5

    def loss(backend, dtype):
        xx = x.to(torch.bfloat16).to(dtype).requires_grad_()
        q, k, v = xx.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
        o = fa.attention(q, k, v, backend=backend)
        return (o.transpose(1, 2).reshape(b, n, h * d).float() @ w).square().sum(), xx

    got, xg = loss("triton_jvp", torch.bfloat16)
    got.backward()
    ref, xr = loss("math", torch.float32)
    ref.backward()
    assert rel_err(xg.grad, xr.grad) < 3e-2


def test_fused_backward_after_sdpas_own_cudnn_backward_at_the_same_shapes():
    """attention=auto in one process: SDPA's own cuDNN forward + backward (O laid out in q's order), then the fused
    attention's backward through cuDNN at the same q, k, v (an rCM student's plain and JVP calls). Its gradient matches
    float64. Before the fused backward fed cuDNN O in q's order, this order of calls reused SDPA's cached graph on a
    contiguous O (the mechanism found on the fifty-first day; the one student that diverged, with attention=auto, ran so).
    dO comes in q's order, as the DiT's output projection (reading O as (B, L, H * D)) sends it back: PyTorch 2.11 keys
    the graph by q, k and v alone, so SDPA's own backward with dO laid out otherwise caches a graph that no feed of
    ours can match (tools/gpu/cudnn_probe.py runs each order of calls in its own process)."""
    _skip_without_cudnn(torch.bfloat16, 64)
    b, n, h, d = 4, 196, 6, 64
    qkv = torch.randn(b, n, 3, h, d, device="cuda").to(torch.bfloat16).requires_grad_()
    g = torch.randn(b, n, h, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o_sdpa = torch.nn.functional.scaled_dot_product_attention(*qkv.permute(2, 0, 3, 1, 4))
    except RuntimeError as err:  # this build's SDPA refuses cuDNN here: nothing cached to collide with
        pytest.skip(f"SDPA's cuDNN backend: {err}")
    (o_sdpa * g).sum().backward()
    qkv.grad = None
    o = fa.attention(*qkv.permute(2, 0, 3, 1, 4), backend="triton_jvp")
    (o * g).sum().backward()
    q, k, v = qkv.detach().permute(2, 0, 3, 1, 4)
    for got, ref in zip(qkv.grad.permute(2, 0, 3, 1, 4), grads64(q, k, v, g)):
        assert rel_err(got, ref) < TOL[torch.bfloat16]


def test_flms_sdpa_backend_and_the_fused_backward_share_cudnn_graphs_whatever_the_do_layout():
    """flm's sdpa backend hands SDPA's cuDNN backward dO in q's order (flm.attention.layout.GradInQOrder), so a consumer
    of O that sends dO back contiguous, then another in q's order, then the fused attention, all at the same q, k, v,
    get float64's gradients: PyTorch 2.11 builds one backward graph per q, k, v with its first call's O and dO strides."""
    _skip_without_cudnn(torch.bfloat16, 64)
    b, n, h, d = 4, 196, 6, 64
    qkv = torch.randn(b, n, 3, h, d, device="cuda").to(torch.bfloat16).requires_grad_()
    g = torch.randn(b, h, n, d, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.detach().permute(2, 0, 3, 1, 4)
    for backend, do in (("sdpa", g), ("sdpa", g.transpose(1, 2).contiguous().transpose(1, 2)), ("triton_jvp", g)):
        qkv.grad = None
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = fa.attention(*qkv.permute(2, 0, 3, 1, 4), backend=backend)
        except RuntimeError as err:  # this build's SDPA refuses cuDNN here: nothing cached to collide with
            pytest.skip(f"SDPA's cuDNN backend: {err}")
        o.backward(do)
        for got, ref in zip(qkv.grad.permute(2, 0, 3, 1, 4), grads64(q, k, v, do)):
            assert rel_err(got, ref) < TOL[torch.bfloat16], backend


def test_hopper_defaults_to_cudnn():
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] == 9
    expected = "cudnn" if hopper and triton_jvp.cudnn_unsupported(q.device, q.dtype, 64) is None else "torch_fa2"
    if expected == "torch_fa2" and triton_jvp._flash_attn_backward() is not None:
        expected = "flash_attn"
    assert triton_jvp.backward_impl(q) == expected
    assert triton_jvp._CUDNN_VERDICTS.get((q.device, q.dtype, 64)) is None  # its self-check passed (or never ran)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_jvp_attention_gradient_end_to_end_matches_sdpa(monkeypatch, causal, dtype):
    """flm.attention.attention(backend='triton_jvp') through autograd, plain and with dual tangents (the
    fused JVP forward), with the backward forced to cuDNN's, against SDPA's gradient."""
    _skip_without_cudnn(dtype, 64)
    monkeypatch.setenv(triton_jvp.BACKWARD_ENV, "cudnn")
    q, k, v, do = _inputs(2, 4, 1024, 64, dtype, seed=1)
    tq, tk, tv, _ = _inputs(2, 4, 1024, 64, dtype, seed=2)

    def grads(backend, dual):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        if dual:
            o, _ = fa.jvp_attention(*leaves, tq, tk, tv, causal=causal)
        else:
            o = fa.attention(*leaves, backend=backend, causal=causal)
        o.backward(do)
        return [x.grad for x in leaves]

    ref = grads("sdpa", dual=False)
    ref64 = grads64(q, k, v, do, causal=causal)
    for dual in (False, True):
        for g, r, r64 in zip(grads("triton_jvp", dual), ref, ref64):
            assert rel_err(g, r64) < TOL[dtype]
            assert rel_err(g, r) < 2 * TOL[dtype]  # both are a TOL from float64
