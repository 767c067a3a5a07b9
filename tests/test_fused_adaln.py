"""flm.kernels.adaln: the fused adaLN layer norm's forward, JVP and backward and the gated residual's JVP and backward
against PyTorch's ops (the same flm.nn Functions with the kernels off), in Triton's CPU interpreter; on a GPU too
(`gpu`)."""

import pytest
import torch
from torch.autograd import forward_ad

from flm import nn as fnn
from flm.kernels import adaln

# (x shape, weight shape, bias shape, one_plus): adaLN's per-sample vectors, shared ones, none, widths that are not a
# power of two, and row counts that do not fill the last block
CASES = [
    ((2, 5, 24), (2, 1, 24), (2, 1, 24), True),
    ((3, 17, 40), (3, 1, 40), (3, 1, 40), True),
    ((2, 5, 24), (24,), (24,), False),
    ((4, 33), (33,), None, False),
    ((2, 3, 4, 16), (2, 1, 1, 16), None, True),
    ((2, 9, 24), None, (2, 1, 24), False),
    ((2, 9, 24), None, None, False),
]


def _call(x, w, b, one_plus, out_dtype=None):
    return fnn._LayerNorm.apply(x, w, b, 1e-6, one_plus, out_dtype)[0]


def _inputs(case):
    xs, ws, bs, one_plus = case
    g = torch.Generator().manual_seed(0)

    def make(shape, scale=1.0):
        return None if shape is None else torch.randn(shape, generator=g) * scale + 0.3

    return make(xs, 2.0), make(ws, 0.5), make(bs), one_plus


def _both(fn, monkeypatch):
    """fn() with the kernels off, then on."""
    monkeypatch.setattr(adaln, "FORCE", False)
    plain = fn()
    monkeypatch.setattr(adaln, "FORCE", True)
    return plain, fn()


@pytest.mark.parametrize("case", CASES)
def test_forward_matches_pytorch(case, monkeypatch):
    x, w, b, one_plus = _inputs(case)
    assert adaln.plan(x, w, b) is not None
    plain, fused = _both(lambda: _call(x, w, b, one_plus), monkeypatch)
    assert fused.dtype == plain.dtype and fused.shape == plain.shape
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_forward_writes_the_requested_dtype(monkeypatch):
    x, w, b, _ = _inputs(CASES[0])
    plain, fused = _both(lambda: _call(x, w, b, True, torch.float16), monkeypatch)
    assert fused.dtype == torch.float16
    torch.testing.assert_close(fused, plain, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_pytorch(case, monkeypatch):
    x, w, b, one_plus = _inputs(case)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]

    def grads():
        return torch.autograd.grad(_call(x, w, b, one_plus), leaves, gy)

    plain, fused = _both(grads, monkeypatch)
    for p, f in zip(plain, fused, strict=True):
        assert f.shape == p.shape and f.dtype == p.dtype
        torch.testing.assert_close(f, p, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tile", [64, 256, 8192])  # 1, 4 and 16 rows of width 64 a program: other partial sums
def test_backwards_at_any_tile_match_pytorch(tile, monkeypatch):
    """The backwards' own tile (BWD_TILE) moves only how rows are split among programs, not the gradients."""
    monkeypatch.setattr(adaln, "BWD_TILE", tile)
    x, w, b, one_plus = _inputs(CASES[1])
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.requires_grad_() for t in (x, w, b)]

    def grads():  # the modulation, then a gated residual of its output, as in a block
        return torch.autograd.grad(fnn.gated_residual(x, w, _call(x, w, b, one_plus)), leaves, gy)

    plain, fused = _both(grads, monkeypatch)
    for p, f in zip(plain, fused, strict=True):
        torch.testing.assert_close(f, p, atol=1e-4, rtol=1e-4)


def test_backward_returns_only_the_gradients_asked_for(monkeypatch):
    monkeypatch.setattr(adaln, "FORCE", True)
    x, w, b, _ = _inputs(CASES[0])
    w.requires_grad_()
    (gw,) = torch.autograd.grad(_call(x, w, b, True).square().sum(), (w,))
    assert gw.shape == w.shape


@pytest.mark.parametrize("case", CASES)
def test_jvp_matches_pytorch(case, monkeypatch):
    x, w, b, one_plus = _inputs(case)
    tangents = [None if t is None else torch.randn_like(t) for t in (x, w, b)]

    def tangent():
        with forward_ad.dual_level():
            duals = [t if dt is None else forward_ad.make_dual(t, dt) for t, dt in zip((x, w, b), tangents)]
            return forward_ad.unpack_dual(_call(*duals, one_plus)).tangent

    plain, fused = _both(tangent, monkeypatch)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)


def test_jvp_of_the_modulation_alone(monkeypatch):
    """x plain, shift and scale dual (the network's input tangent reaching adaLN through the time embedding only)."""
    x, w, b, _ = _inputs(CASES[0])
    tw, tb = torch.randn_like(w), torch.randn_like(b)

    def tangent():
        with forward_ad.dual_level():
            y = fnn.modulate(x, forward_ad.make_dual(b, tb), forward_ad.make_dual(w, tw))
            return forward_ad.unpack_dual(y).tangent

    plain, fused = _both(tangent, monkeypatch)
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_shapes_the_kernels_do_not_take_fall_back(monkeypatch):
    monkeypatch.setattr(adaln, "FORCE", True)
    x = torch.randn(2, 5, 24)
    per_token = torch.randn(2, 5, 24)
    assert adaln.plan(x, per_token, None) is None
    assert adaln.plan(x.transpose(0, 1), None, None) is None
    assert adaln.plan(torch.randn(2, 5, adaln.MAX_D * 2), None, None) is None
    y = _call(x, per_token, None, False)  # PyTorch's ops, the same result
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (24,), eps=1e-6) * per_token)


def test_off_by_default_on_the_cpu():
    assert not adaln.enabled(torch.randn(2, 3))


def test_on_by_default_on_cuda_unless_the_environment_or_force_says_otherwise(monkeypatch):
    class OnCuda:  # all that enabled reads of a tensor once traced is patched out
        is_cuda = True

    monkeypatch.setattr(adaln, "traced", lambda x: False)
    monkeypatch.delenv(adaln.ENV, raising=False)
    assert adaln.enabled(OnCuda())
    monkeypatch.setenv(adaln.ENV, "0")
    assert not adaln.enabled(OnCuda())
    monkeypatch.setattr(adaln, "FORCE", True)
    assert adaln.enabled(OnCuda())
    monkeypatch.delenv(adaln.ENV)
    monkeypatch.setattr(adaln, "FORCE", False)
    assert not adaln.enabled(OnCuda())


def test_a_kernel_that_fails_names_the_way_back_to_pytorchs_ops(monkeypatch):
    class Broken:  # a kernel that Triton cannot build here
        __name__ = "_ln_fwd"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise ValueError("out of resources: shared memory")

            return launch

    monkeypatch.setattr(adaln, "FORCE", True)
    monkeypatch.setattr(adaln, "_ln_fwd", Broken())
    x, w, b, one_plus = _inputs(CASES[0])
    with pytest.raises(RuntimeError, match=r"_ln_fwd failed on cpu \(ValueError: out of resources.*FLM_FUSED_ADALN=0"):
        _call(x, w, b, one_plus)


def test_never_on_tensors_a_kernel_cannot_read(monkeypatch):
    """torch.func's wrappers and fake tensors have no storage for a launch: PyTorch's ops run there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(adaln, "FORCE", True)
    x = torch.randn(2, 3)
    assert adaln.enabled(x)
    seen = []
    torch.func.vmap(lambda row: seen.append(adaln.enabled(row)) or row)(x)
    assert seen == [False]
    with FakeTensorMode():
        assert not adaln.enabled(torch.empty(2, 3))


# gated residual x + gate * h: (x and h shape, gate shape, h's dtype)
GATE_CASES = [
    ((2, 5, 24), (2, 1, 24), torch.float32),
    ((3, 17, 40), (3, 1, 40), torch.float16),
    ((2, 5, 24), (24,), torch.float32),
    ((4, 33), (4, 33), torch.float16),
]


def _gate_inputs(case):
    shape, gshape, hdtype = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    gate = torch.randn(gshape, generator=g).to(hdtype)
    return x, gate, torch.randn(shape, generator=g).to(hdtype)


@pytest.mark.parametrize("case", GATE_CASES)
def test_gated_residual_backward_matches_pytorch(case, monkeypatch):
    x, gate, h = _gate_inputs(case)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.requires_grad_() for t in (x, gate, h)]

    def grads():
        return torch.autograd.grad(fnn.gated_residual(x, gate, h), leaves, gy)

    plain, fused_grads = _both(grads, monkeypatch)
    for p, f in zip(plain, fused_grads, strict=True):
        assert f.shape == p.shape and f.dtype == p.dtype
        torch.testing.assert_close(f.float(), p.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", GATE_CASES)
@pytest.mark.parametrize("which", [(True, True, True), (False, True, False), (True, False, True)])
def test_gated_residual_jvp_matches_pytorch(case, which, monkeypatch):
    x, gate, h = _gate_inputs(case)
    tangents = [torch.randn_like(t) if on else None for t, on in zip((x, gate, h), which)]

    def tangent():
        with forward_ad.dual_level():
            duals = [t if dt is None else forward_ad.make_dual(t, dt) for t, dt in zip((x, gate, h), tangents)]
            return forward_ad.unpack_dual(fnn.gated_residual(*duals)).tangent

    plain, fused_t = _both(tangent, monkeypatch)
    assert fused_t.dtype == plain.dtype and fused_t.shape == plain.shape
    torch.testing.assert_close(fused_t.float(), plain.float(), atol=2e-3, rtol=2e-3)


def test_gated_residual_with_a_per_token_gate_falls_back(monkeypatch):
    monkeypatch.setattr(adaln, "FORCE", True)
    x, h = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    assert adaln.gate_plan(x, torch.randn(2, 5, 24), h) is None
    assert adaln.gate_plan(torch.randn(2, 1, 24), torch.randn(2, 1, 24), torch.randn(2, 5, 24)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_dit_block_shapes(dtype, monkeypatch):
    """DiT-S/2's adaLN at a training batch (fp32 residual stream, bf16 or fp32 modulation vectors): forward, gradients
    and tangent of a modulation and a gated residual as PyTorch's ops give them."""
    x = torch.randn(8, 256, 384, device="cuda") * 2
    w, b = (torch.randn(8, 1, 384, device="cuda", dtype=dtype) * 0.5 for _ in range(2))
    gy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    tx, tw, tb = torch.randn_like(x), torch.randn_like(w), torch.randn_like(b)
    leaves = [t.requires_grad_() for t in (x, w, b)]

    h = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
    th = torch.randn_like(h)

    def run():  # the modulation, then the gated residual with the modulation's output as h (as in a block)
        y = _call(x, w, b, True, torch.bfloat16)
        out = fnn.gated_residual(x, w, y * h)
        grads = torch.autograd.grad(out, [*leaves, h], gy.float())
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(t.detach(), dt) for t, dt in zip((x, w, b, h), (tx, tw, tb, th))]
            ty = fnn.gated_residual(duals[0], duals[1], _call(*duals[:3], True, torch.bfloat16) * duals[3])
            ty = forward_ad.unpack_dual(ty).tangent
        return y, out, ty, *grads

    plain, fused = _both(run, monkeypatch)
    again = run()  # the kernels' second launches go through flm.kernels.launch.DirectLaunch
    for p, f, g in zip(plain, fused, again, strict=True):
        assert f.dtype == p.dtype
        # bf16 affines: a one-ulp difference in the bf16 y, times h and the gate, can reach ~0.06 in a few elements of
        # ~0.5 (one in 786432 on an H100); the affines' gradients are bf16 sums over 256 tokens, where summing in another
        # order moves an element by an ulp of the largest ones (0.25 at ~40, 5 of 3072 on an H100). The mean error
        # bounds the rest.
        atol = 5e-2 if dtype == torch.float32 else max(1e-1, 2**-7 * p.float().abs().max().item())
        torch.testing.assert_close(f.float(), p.float(), atol=atol, rtol=2e-2)
        assert (f.float() - p.float()).abs().mean() <= 1e-2 * p.float().abs().mean()
        torch.testing.assert_close(g, f, atol=0, rtol=0)


@pytest.mark.parametrize(
    "objective_name, options",
    [("flow_matching", {}), ("meanflow", {}), ("scm", {}), ("scm", {"jvp_mode": "two_pass"}), ("scm", {"jvp_mode": "func"})],
)
def test_a_dit_step_with_the_kernels_gives_pytorchs_loss_and_gradients(objective_name, options, monkeypatch):
    """A whole loss through the DiT (every adaLN and the final layer's norm on the kernels; MeanFlow and sCM through
    their JVPs too, in each JVP mode) gives the loss and every gradient of PyTorch's ops."""
    from flm.models import DiT
    from flm.objectives import build_objective

    torch.manual_seed(0)
    model = DiT(input_size=8, in_channels=1, patch_size=2, hidden_size=32, depth=2, num_heads=2, num_classes=10,
                time_inputs=2 if objective_name == "meanflow" else 1, attention="math")  # fmt: skip
    with torch.no_grad():  # DiT's zero init would leave the modulation's scale and the gates at zero
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    objective = build_objective(objective_name, **options)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))

    def step():
        model.zero_grad()
        torch.manual_seed(1)
        loss, _ = objective.loss(model, x, y)
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, fused = _both(step, monkeypatch)
    assert len(plain) == len(fused) > 10
    for p, f in zip(plain, fused, strict=True):
        torch.testing.assert_close(f, p, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("expanded", [False, True])
def test_the_jvps_read_the_modulations_tangents_in_place(expanded, monkeypatch):
    """The DiT's shift, scale and gate and their tangents are (B, 1, D) slices of one (B, 1, 6 D) modulation: the
    kernels read the tangents through their sample stride, as the vectors themselves, with no copy (and an expanded,
    stride-0 tangent as a shared vector), and give PyTorch's tangents."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_):  # not the interpreter's own
                self.count += not any("triton/runtime/interpreter" in f.filename for f in traceback.extract_stack())
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    x, h, tx, th = (torch.randn(3, 5, 24, generator=g) for _ in range(4))
    mods = torch.randn(3, 1, 3 * 24, generator=g)
    tmods = torch.randn(1, 1, 3 * 24, generator=g).expand(3, 1, -1) if expanded else torch.randn(3, 1, 3 * 24, generator=g)
    copies = []

    def tangents():
        with forward_ad.dual_level():
            shift, scale, gate = forward_ad.make_dual(mods, tmods).chunk(3, dim=-1)
            dx = forward_ad.make_dual(x, tx)
            with Copies() as counted:
                y = fnn.modulate(dx, shift, scale)
                z = fnn.gated_residual(dx, gate, forward_ad.make_dual(h, th))
            copies.append(counted.count)
            return forward_ad.unpack_dual(y).tangent, forward_ad.unpack_dual(z).tangent

    plain, fused = _both(tangents, monkeypatch)
    for p, f in zip(plain, fused, strict=True):
        torch.testing.assert_close(f, p, atol=1e-4, rtol=1e-4)
    assert copies[1] == 0, f"the fused JVPs copied {copies[1]} tensors"
