"""The layout every cuDNN attention backward made through flm gets O and dO in: dense in q's stride order
(flm.attention.layout). PyTorch caches cuDNN's backward graphs under q, k and v alone, so one layout per q is what keeps
SDPA's and the fused attention's backwards right beside each other on Hopper; these CPU tests hold the rule."""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from flm.attention import attention, sdpa
from flm.attention.layout import GradInQOrder, in_q_order

_PLAIN_SDPA = F.scaled_dot_product_attention
_Q_LAYOUTS = {  # (B, H, N, D) = (2, 3, 5, 8) views of the storages a caller's q comes in
    "contiguous": lambda: torch.randn(2, 3, 5, 8),
    "projection": lambda: torch.randn(2, 5, 3, 3, 8).permute(2, 0, 3, 1, 4)[0],  # the DiT's (B, N, 3, H, D)
    "sequence_first": lambda: torch.randn(5, 2, 3, 3, 8).permute(2, 1, 3, 0, 4)[0],  # (N, B, 3, H, D)
    "heads_outer": lambda: torch.randn(3, 2, 5, 8).transpose(0, 1),  # (H, B, N, D)
}
_DO_LAYOUTS = {  # how a consumer of O may send its gradient back
    "contiguous": lambda: torch.randn(2, 3, 5, 8),
    "tokens_then_heads": lambda: torch.randn(2, 5, 3, 8).transpose(1, 2),  # O read as (B, N, H * D)
    "heads_outer": lambda: torch.randn(3, 2, 5, 8).transpose(0, 1),
}


def test_cudnn_backward_gets_o_and_do_in_qs_order():
    """in_q_order lays O (and dO) out dense in q's order of heads and tokens, whatever their own layout; no copy when
    they already are."""
    qkv = torch.randn(2, 5, 3, 4, 8)
    q_views = qkv.permute(2, 0, 3, 1, 4)[0]  # the DiT's q: (B, H, N, D) over (B, N, 3, H, D) storage
    q_contiguous = torch.randn(2, 4, 5, 8)
    o = torch.randn(2, 4, 5, 8)
    o_bnhd = in_q_order(o, q_views)
    assert o_bnhd.transpose(1, 2).is_contiguous() and torch.equal(o_bnhd, o)
    assert in_q_order(o_bnhd, q_views) is o_bnhd
    assert in_q_order(o, q_contiguous) is o
    back = in_q_order(o_bnhd, q_contiguous)
    assert back.is_contiguous() and torch.equal(back, o)


@pytest.mark.parametrize("layout", list(_Q_LAYOUTS))
def test_cudnn_feed_lays_o_out_as_sdpas_own_forward(layout):
    """O and dO reach cuDNN's backward with the strides PyTorch's own cuDNN attention forward gives its O for that q
    (its meta kernel, on the meta device): the backward graph cached under q, k and v is built for those."""
    q = _Q_LAYOUTS[layout]()
    meta_q = torch.empty_strided(q.shape, q.stride(), device="meta")
    sdpa_o = torch.ops.aten._scaled_dot_product_cudnn_attention(meta_q, meta_q, meta_q, None, True)[0]
    for x in (torch.randn(2, 3, 5, 8), torch.randn(2, 5, 3, 8).transpose(1, 2)):
        fed = in_q_order(x, q)
        assert fed.stride() == sdpa_o.stride() and torch.equal(fed, x)
        assert in_q_order(fed, q) is fed  # no copy when already so


@pytest.fixture
def as_on_hopper(monkeypatch):
    """The sdpa backend as on a GPU where SDPA may pick cuDNN (on the CPU it leaves dO as it comes)."""
    monkeypatch.setattr(sdpa, "cudnn_may_run", lambda q: True)


def _recording_sdpa(monkeypatch):
    """F.scaled_dot_product_attention that records (q, the dO its backward receives)."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        o = sdpa(q, k, v, **kw)
        o.register_hook(lambda g: seen.append((q, g)))
        return o

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("do_layout", list(_DO_LAYOUTS))
@pytest.mark.parametrize("q_layout", list(_Q_LAYOUTS))
def test_sdpa_backend_hands_its_backward_do_in_qs_order(monkeypatch, as_on_hopper, q_layout, do_layout, masked):
    """Whatever layout the consumer of O sends dO back in, SDPA's backward receives it dense in q's stride order (the
    layout its own O has and the fused backward feeds cuDNN), and the gradients are those of plain SDPA, bit for bit."""
    q = _Q_LAYOUTS[q_layout]().requires_grad_()
    k, v = torch.randn(2, 3, 7, 8, requires_grad=True), torch.randn(2, 3, 7, 8, requires_grad=True)
    keep = torch.tensor([[True] * 7, [True] * 4 + [False] * 3]) if masked else None
    do = _DO_LAYOUTS[do_layout]()
    seen = _recording_sdpa(monkeypatch)
    o = attention(q, k, v, backend="sdpa", key_padding_mask=keep)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ((q_seen, do_seen),) = seen
    assert q_seen is q
    assert in_q_order(do_seen, q) is do_seen
    monkeypatch.setattr(F, "scaled_dot_product_attention", _PLAIN_SDPA)
    mask = None if keep is None else torch.where(keep[:, None, None, :], 0.0, float("-inf"))
    plain = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), do)
    for g, ref in zip(grads, plain):
        assert torch.equal(g, ref)


def test_no_copy_where_do_arrives_in_qs_order_and_no_wrapper_without_grad(as_on_hopper):
    q = _Q_LAYOUTS["projection"]().requires_grad_()
    do = in_q_order(torch.randn(2, 3, 5, 8), q)
    seen = []
    o = attention(q, q, q, backend="sdpa")
    o.grad_fn.register_prehook(lambda grads: seen.append(grads[0]))  # what GradInQOrder's backward receives
    assert type(o.grad_fn).__name__ == "GradInQOrderBackward"
    o.backward(do)
    assert seen[0] is not None and seen[0].data_ptr() == do.data_ptr()
    with torch.no_grad():
        assert attention(q, q, q, backend="sdpa").grad_fn is None
    plain = torch.randn(2, 3, 5, 8)
    assert attention(plain, plain, plain, backend="sdpa").grad_fn is None


def test_no_wrapper_where_sdpa_cannot_run_cudnn():
    """On the CPU (and CUDA before Hopper) no cuDNN graph is cached: SDPA's output goes out as it is, no Python
    backward node in the way (host time)."""
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    assert not sdpa.cudnn_may_run(q)
    assert type(attention(q, q, q, backend="sdpa").grad_fn).__name__ != "GradInQOrderBackward"


def test_sdpa_backend_jvp_runs_without_the_wrapper(as_on_hopper):
    """Under forward AD the backend runs SDPA's math kernel, which builds no cuDNN graph; GradInQOrder (no forward-mode
    rule) stays out of the way."""
    q, tq = torch.randn(2, 3, 5, 8, requires_grad=True), torch.randn(2, 3, 5, 8)
    with forward_ad.dual_level():
        o, to = forward_ad.unpack_dual(attention(forward_ad.make_dual(q, tq), q, q, backend="sdpa"))
    assert to is not None and to.shape == q.shape
    o.sum().backward()
    assert q.grad is not None


def test_grad_in_q_order_function_is_identity_forward():
    o = torch.randn(2, 3, 5, 8, requires_grad=True)
    out = GradInQOrder.apply(o, (0, 2, 1, 3))
    assert torch.equal(out, o)
    g = torch.randn(2, 3, 5, 8)
    (back,) = torch.autograd.grad(out, o, g)
    assert back.transpose(1, 2).is_contiguous() and torch.equal(back, g)


@pytest.mark.parametrize("q_layout", _Q_LAYOUTS)
@pytest.mark.parametrize("x_layout", [*_DO_LAYOUTS, "size_one_dim"])
def test_remembered_orders_and_strides_give_the_uncached_layout(q_layout, x_layout):
    """q_order and dense_in_order remember their answers per size and strides (host time: ~25 us less per fused
    forward + backward on the CPU); the answers are those worked out afresh, a size-1 dim's odd stride included, and x
    comes back itself (no copy) exactly where it already is dense in q's order."""
    from flm.attention import layout

    q = _Q_LAYOUTS[q_layout]()
    make = _DO_LAYOUTS.get(x_layout, lambda: torch.randn(2, 3, 1, 8).as_strided((2, 3, 1, 8), (24, 8, 99, 1)))
    for _ in range(2):  # the first call fills the caches, the second reads them
        x = make()
        order = layout.q_order(q)
        assert order == layout._q_order(q)
        out = in_q_order(x, q)
        assert torch.equal(out, x) and out.permute(order).is_contiguous()
        assert (out is x) == x.permute(order).is_contiguous()


def test_remembered_falls_back_where_sizes_are_symbolic():
    """torch.compile's dynamic shapes give SymInt sizes, which cannot be dict keys: worked out each time, not kept."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from flm.attention import layout

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(5, ConstantSource("s0"), dynamic_dim=DimDynamic.DYNAMIC), hint=5)
    cache = {}
    assert layout._remembered(cache, (torch.Size([s, 3]), (3, 1)), lambda: "worked out") == "worked out"
    assert cache == {}
    assert layout._remembered(cache, ((2, 3), (3, 1)), lambda: "kept") == "kept" and cache == {((2, 3), (3, 1)): "kept"}
    assert layout._remembered(cache, ((2, 3), (3, 1)), lambda: "not asked") == "kept"
