"""Every backend against the math oracle, the registry, 'auto', and the bad-input errors."""

import pytest
import torch
from torch.autograd import forward_ad

import flm.attention as fa
from tests.attention.reference import attention64, grads64, jvp64, rel_err

CPU_BACKENDS = ["math", "sdpa", "triton_jvp"]


def _qkv(lq=23, lkv=23, d=32, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, n, d, generator=g, **kw) for n in (lq, lkv, lkv))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_and_gradients_match_math(backend, causal):
    q, k, v = (x.requires_grad_() for x in _qkv())
    o = fa.attention(q, k, v, backend=backend, causal=causal)
    assert rel_err(o, attention64(q, k, v, causal=causal)) < 1e-5
    do = torch.randn_like(o)
    o.backward(do)
    for got, ref in zip((q.grad, k.grad, v.grad), grads64(q, k, v, do, causal=causal)):
        assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_jvp_under_dual_tensors_and_torch_func(backend):
    q, k, v = _qkv(lq=19, lkv=27, seed=1)
    tq, tk, tv = _qkv(lq=19, lkv=27, seed=2)
    _, to_ref = jvp64(q, k, v, tq, tk, tv)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv))]
        to_dual = forward_ad.unpack_dual(fa.attention(*duals, backend=backend)).tangent
    _, to_func = torch.func.jvp(lambda a, b, c: fa.attention(a, b, c, backend=backend), (q, k, v), (tq, tk, tv))
    assert rel_err(to_dual, to_ref) < 1e-5
    assert rel_err(to_func, to_ref) < 1e-5


def test_auto_picks_a_backend_that_runs_on_cpu():
    q, k, v = _qkv()
    assert fa.resolve_backend("auto", q, needs_jvp=False) == "sdpa"
    assert fa.resolve_backend("auto", q, needs_jvp=True) == "math"
    assert rel_err(fa.attention(q, k, v), attention64(q, k, v)) < 1e-5


def test_unknown_backend_lists_valid_names():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'.*math, sdpa, flash, triton_jvp"):
        fa.attention(q, k, v, backend="cudnn")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_flash_says_it_needs_cuda_when_chosen():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="'flash' needs a CUDA GPU.*use backend='sdpa'"):
        fa.attention(q, k, v, backend="flash")


def test_flash_refuses_dual_tensors_with_a_pointer_to_triton_jvp(monkeypatch):
    monkeypatch.setattr(fa.flash, "check_available", lambda *args: None)  # pretend we are on a GPU
    q, k, v = _qkv()
    with forward_ad.dual_level():
        dq = forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(ValueError, match="no forward-mode.*triton_jvp"):
            fa.attention(dq, k, v, backend="flash")


def test_triton_jvp_without_cuda_or_interpreter_says_how(monkeypatch):
    monkeypatch.setattr(fa.triton_jvp, "interpreted", lambda: False)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="'triton_jvp' needs a CUDA GPU.*backend='math'.*TRITON_INTERPRET=1"):
        fa.attention(q, k, v, backend="triton_jvp")


def _ok():
    return list(_qkv(lq=8, lkv=8, d=32))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, v: (q[0], k, v), r"q must have 4 dims \(batch, heads, tokens, head_dim\), got shape \(2, 8, 32\)"),
        (lambda q, k, v: (q, k[:1], v), r"k has shape \(1, 2, 8, 32\), expected \(2, 2, Lkv, 32\)"),
        (lambda q, k, v: (q, k[:, :1], v), r"k has shape \(2, 1, 8, 32\), expected \(2, 2, Lkv, 32\)"),
        (lambda q, k, v: (q, k[..., :16], v), r"k has shape \(2, 2, 8, 16\), expected \(2, 2, Lkv, 32\)"),
        (lambda q, k, v: (q, k, v[:, :, :4]), r"v has shape \(2, 2, 4, 32\), expected \(2, 2, 8, 32\)"),
        (lambda q, k, v: (q, k.double(), v), r"k has dtype torch.float64, expected torch.float32"),
        (lambda q, k, v: (q, k, v.to("meta")), r"v is on meta, expected cpu"),
    ],
)
def test_bad_inputs_name_the_tensor(change, match):
    for backend in CPU_BACKENDS:
        with pytest.raises(ValueError, match=match):
            fa.attention(*change(*_ok()), backend=backend)


def test_causal_cross_attention_is_refused():
    q, k, v = _qkv(lq=4, lkv=8)
    with pytest.raises(ValueError, match="causal=True needs self-attention.*4 queries and 8 keys"):
        fa.attention(q, k, v, causal=True)


@pytest.mark.parametrize(
    "which, bad, match",
    [
        (0, lambda t: t[:, :, :3], r"tq has shape \(2, 2, 3, 32\), expected \(2, 2, 8, 32\)"),
        (1, lambda t: t.half(), r"tk has dtype torch.float16, expected torch.float32"),
        (2, lambda t: t.to("meta"), r"tv is on meta, expected cpu"),
    ],
)
def test_bad_tangents_name_the_tensor(which, bad, match):
    q, k, v = _ok()
    tangents = [torch.randn_like(x) for x in (q, k, v)]
    tangents[which] = bad(tangents[which])
    with pytest.raises(ValueError, match=match):
        fa.jvp_attention(q, k, v, *tangents)


@pytest.mark.parametrize("d", [8, 20, 264])
def test_unsupported_head_dim_is_refused_before_launch(d):
    q, k, v = _qkv(lq=4, lkv=4, d=d)
    with pytest.raises(ValueError, match=f"head dims 16..256 that are multiples of 8, got {d}"):
        fa.attention(q, k, v, backend="triton_jvp")


def test_fp64_is_refused_by_triton_jvp():
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32 inputs, got torch.float64"):
        fa.attention(q, k, v, backend="triton_jvp")
