"""FLM_ATTENTION_NATIVE_NODE=1: the fused forward's output under aten's own C++ attention backward node (the CPU flash
kernel's here, in Triton's interpreter; cuDNN's on a GPU in test_native_node_gpu.py) against float64 math attention, and
where flm's autograd.Function stays: off by default, a bias or mask, torch.func.jvp, no gradient wanted."""

import pytest
import torch
from torch.autograd import forward_ad

from flm.attention import attention, native
from flm.attention import triton_jvp
from tests.attention.reference import grads64, jvp64, qkv_and_tangents, rel_err

TOL = 1e-5  # fp32


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv(native.ENV, "1")


def _leaves(*xs):
    return [x.detach().requires_grad_() for x in xs]


def _nodes(o, hops=3):
    """The names of the backward nodes within `hops` of o (a dual's primal sits behind make_dual's node)."""
    names, frontier = [], [o.grad_fn]
    for _ in range(hops):
        frontier = [f for f in frontier if f is not None]
        names += [type(f).__name__ for f in frontier]
        frontier = [g for f in frontier for g, _ in f.next_functions]
    return names


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 72])
def test_dual_inputs_give_the_jvp_and_the_gradients_through_the_native_node(d, causal, on):
    q, k, v, tq, tk, tv = qkv_and_tangents(2, 2, 33, 33, d, seed=1)
    do = torch.randn(2, 2, 33, d)
    q, k, v = _leaves(q, k, v)
    with forward_ad.dual_level():
        duals = (forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv)))
        o, to = forward_ad.unpack_dual(attention(*duals, causal=causal, backend="triton_jvp"))
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in _nodes(o)
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv, causal=causal)
    assert rel_err(o, o_ref) < TOL and rel_err(to, to_ref) < TOL
    for got, ref in zip(torch.autograd.grad(o, (q, k, v), do), grads64(q, k, v, do, causal=causal)):
        assert rel_err(got, ref) < 1e-4


def test_a_plain_call_and_the_dits_head_views_through_the_native_node(on):
    """q, k, v as (B, L, H, D) storage viewed as (B, H, L, D), as the DiT makes them."""
    b, n, h, d = 2, 29, 3, 16
    q, k, v = _leaves(*(torch.randn(b, n, h, d).transpose(1, 2) for _ in range(3)))
    o = attention(q, k, v, backend="triton_jvp")
    assert type(o.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    do = torch.randn(b, h, n, d)
    for got, ref in zip(torch.autograd.grad(o, (q, k, v), do), grads64(q, k, v, do)):
        assert rel_err(got, ref) < 1e-4


def test_flms_function_stays_by_default_with_a_bias_or_mask_under_torch_func_jvp_and_without_a_gradient(monkeypatch):
    q, k, v, tq, tk, tv = qkv_and_tangents(1, 2, 16, 16, 16, seed=2)
    q, k, v = _leaves(q, k, v)
    monkeypatch.delenv(native.ENV, raising=False)
    assert type(attention(q, k, v, backend="triton_jvp").grad_fn).__name__ == "_AttentionWithJVPBackward"
    monkeypatch.setenv(native.ENV, "1")
    bias = torch.randn(1, 2, 16, 16)
    assert type(attention(q, k, v, backend="triton_jvp", bias=bias).grad_fn).__name__ == "_AttentionWithJVPBackward"
    mask = torch.ones(1, 16, dtype=torch.bool)
    o_masked, _ = triton_jvp.jvp_attention(q, k, v, tq, tk, tv, causal=False, scale=0.25, key_padding_mask=mask)
    assert type(o_masked.grad_fn).__name__ == "_JVPAttentionBackward"
    o, to = torch.func.jvp(lambda a, b, c: attention(a, b, c, backend="triton_jvp"), (q, k, v), (tq, tk, tv))
    assert rel_err(to, jvp64(q, k, v, tq, tk, tv)[1]) < TOL  # the Function's jvp rule ran
    with torch.no_grad():
        assert attention(q, k, v, backend="triton_jvp").grad_fn is None


def test_a_wrong_value_names_the_setting(monkeypatch):
    monkeypatch.setenv(native.ENV, "maybe")
    with pytest.raises(ValueError, match="FLM_ATTENTION_NATIVE_NODE='maybe': set 1"):
        native.enabled()
