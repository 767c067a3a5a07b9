"""FLM_ATTENTION_NATIVE_NODE=1 on a GPU whose default backward is cuDNN's (Hopper): the fused forward's output under
aten's cuDNN attention node, against flm's own Function path and float64 math, for the DiT's head views with dO in
either layout, and replayed in a CUDA graph.

Run on a CUDA machine: pytest -m gpu tests/attention/test_native_node_gpu.py
"""

import pytest
import torch
from torch.autograd import forward_ad

import flm.attention as fa
from flm.attention import native, triton_jvp
from tests.attention.reference import grads64, jvp64, rel_err

pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 against float64, as in test_triton_jvp_gpu.py


def _dit_views(b, n, h, d, seed):
    """q, k, v, tq, tk, tv as the DiT makes them: (B, L, H, D) storage viewed as (B, H, L, D)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, n, h, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2) for _ in range(6)]


def _skip_unless_cudnn(q):
    if not torch.cuda.is_available() or triton_jvp.backward_impl(q) != "cudnn":
        pytest.skip("the native node stands for cuDNN's backward, flm's choice on Hopper only")


def _step(q, k, v, tq, tk, tv, do):
    """The dual forward and o's gradient, as a MeanFlow step takes them."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with forward_ad.dual_level():
        duals = (forward_ad.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv)))
        o, to = forward_ad.unpack_dual(fa.attention(*duals, backend="triton_jvp"))
    return o, to, torch.autograd.grad(o, (q, k, v), do)


@pytest.mark.parametrize("do_layout", ["q order", "contiguous"])
@pytest.mark.parametrize("d", [64, 72, 128])
def test_the_native_node_gives_flms_gradients(d, do_layout, monkeypatch):
    q, k, v, tq, tk, tv = _dit_views(2, 300, 4, d, seed=d)
    _skip_unless_cudnn(q)
    do = torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    do = do.contiguous() if do_layout == "contiguous" else do
    monkeypatch.setenv(native.ENV, "0")
    o0, to0, g0 = _step(q, k, v, tq, tk, tv, do)
    monkeypatch.setenv(native.ENV, "1")
    o1, to1, g1 = _step(q, k, v, tq, tk, tv, do)
    assert torch.equal(o0, o1) and torch.equal(to0, to1)  # the same fused forward
    o_ref, to_ref = jvp64(q, k, v, tq, tk, tv)
    assert rel_err(o1, o_ref) < TOL and rel_err(to1, to_ref) < TOL
    for got, flm, ref in zip(g1, g0, grads64(q, k, v, do)):
        assert rel_err(got, ref) < TOL and rel_err(got, flm) < TOL


def test_the_native_node_replays_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv(native.ENV, "1")
    q, k, v, tq, tk, tv = _dit_views(4, 196, 6, 64, seed=3)
    _skip_unless_cudnn(q)
    do = torch.randn_like(q)
    eager = _step(q, k, v, tq, tk, tv, do)  # also the eager warm-up: the forward's tuning, cuDNN's self-check
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _step(q, k, v, tq, tk, tv, do)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(q, k, v, tq, tk, tv, do)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
    for got, ref in zip(captured[2], eager[2]):
        assert rel_err(got, ref) < 1e-3  # cuDNN's backward may accumulate in another order
