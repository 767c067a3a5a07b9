"""flm.nn layers: exact backward and jvp against the plain ops, tangents without a graph.

python -m pytest tests/test_nn.py -q
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.utils._python_dispatch import TorchDispatchMode

from flm import nn as fnn

B, N, D, O = 2, 5, 8, 6


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    return r


# (flm.nn layer, the same computation in plain PyTorch, input shapes)
CASES = {
    "linear": (fnn.linear, F.linear, [(B, N, D), (O, D), (O,)]),
    "linear_nobias": (fnn.linear, F.linear, [(B, N, D), (O, D)]),
    "layer_norm": (
        lambda x: fnn.layer_norm(x),
        lambda x: F.layer_norm(x, (D,), eps=1e-6),
        [(B, N, D)],
    ),
    "layer_norm_affine": (
        lambda x, w, b: fnn.layer_norm(x, w, b),
        lambda x, w, b: F.layer_norm(x, (D,), w, b, eps=1e-6),
        [(B, N, D), (D,), (D,)],
    ),
    "adaln_modulate": (  # per-sample affine: x_hat * (1 + scale) + shift
        lambda x, shift, scale: fnn.layer_norm(x, 1 + scale, shift),
        lambda x, shift, scale: F.layer_norm(x, (D,), eps=1e-6) * (1 + scale) + shift,
        [(B, N, D), (B, 1, D), (B, 1, D)],
    ),
    "modulate": (
        fnn.modulate,
        lambda x, shift, scale: F.layer_norm(x, (D,), eps=1e-6) * (1 + scale) + shift,
        [(B, N, D), (B, 1, D), (B, 1, D)],
    ),
    "gelu_tanh": (fnn.gelu_tanh, lambda x: F.gelu(x, approximate="tanh"), [(B, N, D)]),
    "silu": (fnn.silu, F.silu, [(B, N, D)]),
    "gated_residual": (fnn.gated_residual, lambda x, g, h: x + g * h, [(B, N, D), (B, 1, D), (B, N, D)]),
}


def _in_dual_level(layer):
    """layer called inside a forward-AD level, where every flm.nn layer runs its Function (outside one, `linear` and the
    activations are their plain ops): the way to check the Functions' backward on plain inputs."""

    def call(*args):
        with forward_ad.dual_level():
            return layer(*args)

    return call


@pytest.mark.parametrize("case", CASES)
def test_gradcheck_both_modes(case):
    layer, _, shapes = CASES[case]
    r = _inputs()
    args = [r(*s) for s in shapes]
    assert torch.autograd.gradcheck(layer, args, check_forward_ad=True, check_backward_ad=True)
    assert torch.autograd.gradcheck(_in_dual_level(layer), args)  # the Function's own backward


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_ops(case):
    """Primal, gradient (autograd) and tangent (torch.func.jvp) equal those of the plain ops."""
    layer, plain, shapes = CASES[case]
    r = _inputs(torch.float32, seed=1)
    args = [r(*s) for s in shapes]
    tangents = [torch.randn_like(a) for a in args]
    y, y_ref = layer(*args), plain(*args)
    torch.testing.assert_close(y, y_ref)
    gy = torch.randn_like(y)
    grads_ref = torch.autograd.grad(y_ref, args, gy)
    for call in (layer, _in_dual_level(layer)):  # plain ops or Function outside a dual level; the Function inside one
        grads = torch.autograd.grad(call(*args), args, gy)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)
    detached = [a.detach() for a in args]
    _, ty = torch.func.jvp(layer, tuple(detached), tuple(tangents))
    _, ty_ref = torch.func.jvp(plain, tuple(detached), tuple(tangents))
    torch.testing.assert_close(ty, ty_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_dual_tangent_has_no_graph(case):
    """Primal keeps its gradient; the tangent has no grad_fn although inputs require grad."""
    layer, plain, shapes = CASES[case]
    r = _inputs(torch.float32, seed=2)
    args = [r(*s) for s in shapes]
    tangents = [torch.randn_like(a) for a in args]
    with forward_ad.dual_level():
        y = layer(*[forward_ad.make_dual(a, t) for a, t in zip(args, tangents)])
        y_p, y_t = forward_ad.unpack_dual(y)
        y_ref_t = forward_ad.unpack_dual(plain(*[forward_ad.make_dual(a, t) for a, t in zip(args, tangents)])).tangent
    assert y_t.grad_fn is None and not y_t.requires_grad
    assert y_ref_t.requires_grad  # the plain ops do build a graph: the test can tell them apart
    assert y_p.grad_fn is not None
    torch.testing.assert_close(y_t, y_ref_t.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_saved_tensors_detached_only_while_a_dual_level_is_open(case):
    """A layer detaches what it saves only where tangents can exist (a flow-matching step has none: its detaches were a
    seventh of its aten ops); under a dual level it detaches, so that no saved activation keeps its tangent alive."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Detaches(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket is torch.ops.aten.detach
            return func(*args, **(kwargs or {}))

    layer, _, shapes = CASES[case]
    r = _inputs(torch.float32, seed=3)
    args = [r(*s) for s in shapes]
    with Detaches() as plain:
        layer(*args)
    assert plain.n == 0
    with forward_ad.dual_level(), Detaches() as dual:
        y = layer(*[forward_ad.make_dual(a, torch.randn_like(a)) for a in args])
    assert dual.n > 0 and y.grad_fn is not None


@pytest.mark.parametrize("case", ["linear", "linear_nobias", "gelu_tanh", "silu"])
def test_linear_and_activations_are_plain_ops_outside_a_dual_level(case):
    """Without a forward-AD level no tensor has a tangent, and the layer records aten's own backward node (no Python
    Function's host time: a flow-matching step); inside one it records its Function."""
    layer, _, shapes = CASES[case]
    r = _inputs(torch.float32, seed=4)
    args = [r(*s) for s in shapes]
    python_node = torch.autograd.function.BackwardCFunction
    assert not isinstance(layer(*args).grad_fn, python_node)
    assert isinstance(_in_dual_level(layer)(*args).grad_fn, python_node)


def test_tangent_of_weightless_input_only():
    """Only x carries a tangent (the usual case: weights have none); the weights' tangent is zero."""
    r = _inputs(torch.float32)
    x, w, b = r(B, N, D), r(O, D), r(O)
    tx = torch.randn_like(x)
    with forward_ad.dual_level():
        y = fnn.linear(forward_ad.make_dual(x, tx), w, b)
        ty = forward_ad.unpack_dual(y).tangent
    torch.testing.assert_close(ty, F.linear(tx, w).detach())


def test_linear_module_is_drop_in():
    torch.manual_seed(0)
    lin = fnn.Linear(D, O)
    ref = torch.nn.Linear(D, O)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(B, D)
    torch.testing.assert_close(lin(x), ref(x))


@pytest.mark.skipif(not hasattr(torch, "get_autocast_dtype"), reason="old torch")
def test_linear_under_autocast_matches_f_linear():
    r = _inputs(torch.float32)
    x, w, b = r(B, N, D), r(O, D), r(O)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = fnn.linear(x, w, b), F.linear(x, w, b)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref)
    gw, gw_ref = (torch.autograd.grad(v.float().sum(), w)[0] for v in (y, y_ref))
    assert gw.dtype == torch.float32
    torch.testing.assert_close(gw, gw_ref)


def test_joins_and_scaled_keep_the_primal_and_tangent_of_the_plain_ops():
    x, tx, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(1, 3, 4)
    assert fnn.joins(b, x) is b and torch.equal(fnn.scaled(x, 0.3), x * 0.3)  # no dual: the plain tensors
    with forward_ad.dual_level():
        d = forward_ad.make_dual(x, tx)
        joined = fnn.joins(b, d)
        assert torch.equal(forward_ad.unpack_dual(joined).tangent, torch.zeros_like(b))
        for fast, plain in ((d + joined, d + b), (fnn.scaled(d, 0.3), d * 0.3)):
            got, want = forward_ad.unpack_dual(fast), forward_ad.unpack_dual(plain)
            assert torch.equal(got.primal, want.primal) and torch.equal(got.tangent, want.tangent)


def test_signed_binds_like_inspect():
    """signed's fast binding (positional arguments that fill the signature) gives what inspect's binding gives, and
    any other call binds, or fails, as inspect does."""
    import inspect

    @fnn.signed
    class F(torch.autograd.Function):
        @staticmethod
        def forward(x, scale, shift=0.0):
            return x * scale + shift

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, gy):
            return gy, None, None

    sig, plain = inspect.signature(F.forward), inspect.Signature(list(inspect.signature(F.forward).parameters.values()))
    x = torch.ones(2)
    for args, kwargs in [((x, 2.0, 1.0), {}), ((x, 2.0), {}), ((x,), {"scale": 3.0})]:
        fast, ref = sig.bind(*args, **kwargs), plain.bind(*args, **kwargs)
        fast.apply_defaults(), ref.apply_defaults()
        assert (fast.args, fast.kwargs) == (ref.args, ref.kwargs)
    with pytest.raises(TypeError):
        sig.bind(x, 1.0, 2.0, 3.0)
    assert torch.equal(F.apply(x, 2.0), x * 2) and torch.equal(F.apply(x, 2.0, 1.0), x * 2 + 1)


def test_eager_calls_take_the_old_style_twin_and_torch_func_the_function():
    """`apply` runs a signed Function's old-style twin in eager code (no argument binding) and the Function itself under
    torch.func.jvp: the same output, tangent and gradients either way, the twin's node named as the Function's."""
    r = _inputs()
    x, w, b = r(B, N, D), r(O, D), r(O)
    tx = torch.randn(B, N, D, dtype=torch.float64)
    with forward_ad.dual_level():
        y = fnn.linear(forward_ad.make_dual(x, tx), w, b)
        node = y.grad_fn
        y, ty = forward_ad.unpack_dual(y)
    assert node._forward_cls is fnn._Linear.eager and type(node).__name__ == "_LinearBackward"
    gx, gw, gb = torch.autograd.grad(y.square().sum(), (x, w, b))
    with forward_ad.dual_level():  # the Function itself, as torch.func's transforms and torch.compile take it
        y2 = fnn._Linear.apply(forward_ad.make_dual(x, tx), w, b)
        node = y2.grad_fn
        y2, ty2 = forward_ad.unpack_dual(y2)
    assert node._forward_cls is fnn._Linear
    assert torch.equal(y, y2) and torch.equal(ty, ty2)
    assert all(torch.equal(a, c) for a, c in zip((gx, gw, gb), torch.autograd.grad(y2.square().sum(), (x, w, b))))
    _, ty3 = torch.func.jvp(lambda x: fnn.linear(x, w.detach(), b.detach()), (x.detach(),), (tx,))
    assert torch.equal(ty3, ty)


def test_cast_cache_casts_each_parameter_once_per_version():
    """Inside cast_cache a parameter's autocast cast is made once and reused, as torch.autocast's own cache does:
    by a no-grad forward and then a grad one (the gradient still reaches the parameter), until the parameter
    changes in place. Tensors that are not parameters, inference mode, and code outside the context cast anew."""
    lin = fnn.Linear(D, O)
    x = torch.randn(B, N, D)
    bf16 = torch.bfloat16
    with torch.autocast("cpu", dtype=bf16):
        assert fnn._cast(lin.weight, bf16) is not fnn._cast(lin.weight, bf16)  # no cache outside the context
        with fnn.cast_cache():
            with torch.no_grad():
                first = fnn._cast(lin.weight, bf16)
            assert first.grad_fn is not None  # made for a later forward's gradient too
            assert fnn._cast(lin.weight, bf16) is first
            with fnn.cast_cache():  # a nested context shares the outer one's casts
                assert fnn._cast(lin.weight, bf16) is first
            plain = torch.randn(O, D)
            assert fnn._cast(plain, bf16) is not fnn._cast(plain, bf16)
            with torch.inference_mode():
                assert fnn._cast(lin.weight, bf16) is not first
            lin(x).float().sum().backward()
            assert lin.weight.grad is not None and lin.bias.grad is not None
            with torch.no_grad():
                lin.weight.add_(1.0)  # an in-place change: a new version, a new cast
            again = fnn._cast(lin.weight, bf16)
            assert again is not first and torch.equal(again, lin.weight.to(bf16))
        assert fnn._casts is None
        assert fnn._cast(lin.weight, bf16) is not fnn._cast(lin.weight, bf16)


def _meanflow_three_forwards():
    """(model, objective, x, y): a small DiT under MeanFlow with the model's tangent and the JVP on the r != t samples,
    whose loss runs the network three times (a no-grad forward, the r = t forward, the dual forward)."""
    from flm.models import DiT
    from flm.objectives import build_objective

    torch.manual_seed(0)
    model = DiT(input_size=8, in_channels=1, patch_size=2, hidden_size=32, depth=2, num_heads=1, num_classes=10,
                time_inputs=2, attention="math", prediction="data")  # fmt: skip
    objective = build_objective("meanflow", jvp_subset=True, tangent="model", r_neq_t=0.5)
    return model, objective, torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))


class _OpNames(TorchDispatchMode):
    """The aten ops dispatched inside it, by name, in order (`names`)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_cast_cache_gives_the_uncached_gradients_of_a_meanflow_step():
    """MeanFlow with the model's tangent and the JVP on the r != t samples runs the network three times per loss; with
    shared casts its gradients add up in bf16 before the one cast back (torch.autocast's own semantics), so they match
    the uncached ones to bf16 rounding. And the step issues fewer casts."""
    model, objective, x, y = _meanflow_three_forwards()
    grads, casts = [], []
    for cached in (False, True):
        model.zero_grad()
        torch.manual_seed(1)
        with _OpNames() as ops, torch.autocast("cpu", dtype=torch.bfloat16), fnn.cast_cache(cached):
            loss, _ = objective.loss(model, x, y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        casts.append(ops.names.count("_to_copy"))
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-2 * b.abs().max().item() + 1e-8)
    assert casts[1] < casts[0]


def test_bulk_casts_give_the_per_parameter_casts_gradients_to_the_bit_in_two_ops():
    """cast_cache(params=...) casts the parameters in one op and their gradients back in one (the training loop's way
    in one process). A MeanFlow loss (three forwards, one of them no-grad, one dual) gets the same loss and gradients
    to the bit as with one cast per parameter, a parameter the loss leaves unused gets no gradient, and the step's
    per-parameter casts are gone."""
    model, objective, x, y = _meanflow_three_forwards()
    unused = torch.nn.Parameter(torch.randn(3))
    params = [*model.parameters(), unused]
    results = []
    for bulk in ((), params):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        ops = _OpNames()
        with ops, torch.autocast("cpu", dtype=torch.bfloat16), fnn.cast_cache(True, bulk):
            loss, _ = objective.loss(model, x, y)
        with ops:
            loss.backward()
        results.append((loss.detach(), [p.grad for p in params], ops.names))
    (loss_each, grads_each, ops_each), (loss_bulk, grads_bulk, ops_bulk) = results
    assert torch.equal(loss_each, loss_bulk)
    assert grads_each[-1] is None and grads_bulk[-1] is None  # unused: no gradient, not zeros
    for a, b in zip(grads_each[:-1], grads_bulk[:-1], strict=True):
        assert a is not None and a.dtype == torch.float32 and torch.equal(a, b)
    # every linear's weight and bias was cast, and its gradient cast back, one op each (the label table: no cast)
    n_linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) for _ in m.parameters(recurse=False))
    assert ops_bulk.count("_foreach_copy_") == 2 and "_foreach_copy_" not in ops_each
    assert ops_each.count("_to_copy") - ops_bulk.count("_to_copy") == 2 * n_linear


def test_bulk_casts_skip_what_needs_no_cast():
    """Without autocast, in inference mode, or for parameters already in the autocast dtype, cast_cache(params=...)
    casts nothing in bulk; a parameter changed in place inside the context is cast anew, as in the per-parameter
    cache."""
    lin = fnn.Linear(D, O)
    params = list(lin.parameters())
    with fnn.cast_cache(True, params):
        assert fnn._casts == {}  # autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.inference_mode(), fnn.cast_cache(True, params):
            assert fnn._casts == {}
        with fnn.cast_cache(True, [p.detach().bfloat16().requires_grad_() for p in params]):
            assert fnn._casts == {}
        with fnn.cast_cache(True, params):
            first = fnn._cast(lin.weight, torch.bfloat16)
            assert first.grad_fn is not None and type(first.grad_fn).__name__.startswith("_BulkCast")
            with torch.no_grad():
                lin.weight.add_(1.0)
            again = fnn._cast(lin.weight, torch.bfloat16)
            assert again is not first and torch.equal(again, lin.weight.to(torch.bfloat16))


def test_modulate_writes_the_matmul_dtype_in_its_own_kernels():
    """modulate(..., dtype=bf16) gives what modulate(...).to(bf16) gives, output and tangent to the bit (the affine's
    kernel rounds once, as the cast did) and gradients to bf16 rounding (its backward takes the bf16 gradient of the
    matmul after it, which the cast's backward used to widen first)."""
    r = _inputs(torch.float32)
    x, shift, scale = r(B, N, D), r(B, 1, D).to(torch.bfloat16), r(B, 1, D).to(torch.bfloat16)
    tx, tshift, tscale = torch.randn(B, N, D), torch.randn(B, 1, D).bfloat16(), torch.randn(B, 1, D).bfloat16()
    w = torch.randn(O, D, dtype=torch.bfloat16)
    outs = []
    for fused in (True, False):
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, t) for p, t in ((x, tx), (shift, tshift), (scale, tscale))]
            y = fnn.modulate(*duals, dtype=torch.bfloat16) if fused else fnn.modulate(*duals).to(torch.bfloat16)
            primal, tangent = forward_ad.unpack_dual(y)
        assert y.dtype == tangent.dtype == torch.bfloat16
        grads = torch.autograd.grad((primal @ w.T).float().square().sum(), (x, shift, scale))
        outs.append((primal, tangent, grads))
    (p1, t1, g1), (p2, t2, g2) = outs
    assert torch.equal(p1, p2) and torch.equal(t1, t2)
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
    assert fnn.matmul_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fnn.matmul_dtype(x) == torch.bfloat16
