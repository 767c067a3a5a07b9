"""DiT: shapes, init, bad input, and JVPs through the fused attention.

python -m pytest tests/models -q
"""

import copy

import pytest
import torch
from torch.autograd import forward_ad

import flm.models.dit as dit
from flm.attention.layout import in_q_order, stride_order
from flm.models import MODEL_SIZES, ModelConfig, build_model
from flm.models.dit import T_MIN
from flm.objectives import MeanFlow
from tests.models.tiny import plain_layers, tiny_dit, with_backend


def test_registry_has_the_paper_sizes():
    for size in ("S", "B", "L", "XL"):
        for patch in (2, 4, 8):
            assert f"DiT-{size}/{patch}" in MODEL_SIZES
    assert MODEL_SIZES["DiT-XL/2"] == (28, 1152, 16, 2)
    for name in ("DiT-T/2", "DiT-T/4", "DiT-Ti/7"):
        _, hidden, heads, _ = MODEL_SIZES[name]
        assert hidden // heads >= 16 and (hidden // heads) % 8 == 0


@pytest.mark.parametrize("size,input_size,channels", [("DiT-T/2", 8, 3), ("DiT-T/4", 16, 4), ("DiT-T/2", 6, 1)])
def test_output_shape_and_zero_init(size, input_size, channels):
    model = build_model(size, input_size=input_size, in_channels=channels, num_classes=5, time_inputs=2)
    x = torch.randn(3, channels, input_size, input_size)
    out = model(x, torch.rand(3), torch.zeros(3), torch.tensor([0, 4, 5]))
    assert out.shape == x.shape
    assert torch.count_nonzero(out) == 0  # adaLN-Zero: the output layer starts at zero


def test_conditioning_changes_the_output():
    model = tiny_dit(time_inputs=2)
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.7])
    base = model(x, t, t, torch.tensor([1, 2]))
    assert not torch.allclose(base, model(x, t, t * 0.5, torch.tensor([1, 2])))  # r matters
    assert not torch.allclose(base, model(x, t, t, torch.tensor([3, 2])))  # y matters
    assert not torch.allclose(base, model(x, t + 0.1, t + 0.1, torch.tensor([1, 2])))  # t matters
    null = model(x, t, t, torch.tensor([10, 10]))
    torch.testing.assert_close(model(x, t, t), null)  # y=None is the null class


def test_time_scale_scales_the_embedded_time_and_its_derivative():
    """time_scale s embeds s t: the same weights see t at scale s as 1 t at scale 1, and d/dt grows by s."""
    a, b = tiny_dit(time_inputs=2), tiny_dit(time_inputs=2)
    for emb in (b.t_embedder, b.dt_embedder):
        emb.freqs.mul_(1000.0)
    assert build_model("DiT-T/2", input_size=8, in_channels=3, time_scale=1000.0).t_embedder.freqs.max() == 1000.0
    x, t, r, y = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.7]), torch.tensor([0.1, 0.7]), torch.tensor([1, 2])
    torch.testing.assert_close(b(x, t / 1000, r / 1000, y), a(x, t, r, y), rtol=1e-4, atol=1e-5)
    dt_a = torch.func.jvp(lambda t_: a(x, t_, r, y), (t,), (torch.ones_like(t),))[1]
    dt_b = torch.func.jvp(lambda t_: b(x, t_, r, y), (t,), (torch.ones_like(t),))[1]
    assert dt_b.abs().mean() > 30 * dt_a.abs().mean()  # what the 1000 t of DiT's diffusion code did to MeanFlow


def test_a_data_prediction_is_returned_as_the_linear_paths_velocity():
    """prediction=data: forward gives (x_t - x^) / t (t = 0: T_MIN), x^ being what the same weights output as velocity."""
    velocity = tiny_dit(time_inputs=2)
    data = copy.deepcopy(velocity)
    data.prediction = "data"
    x, t, r, y = torch.randn(3, 3, 8, 8), torch.tensor([1.0, 0.02, 0.0]), torch.tensor([0.0, 0.01, 0.0]), torch.tensor([1, 2, 3])
    x_hat = velocity(x, t, r, y)
    torch.testing.assert_close(data(x, t, r, y), (x - x_hat) / torch.tensor([1.0, 0.02, T_MIN]).reshape(3, 1, 1, 1))
    # MeanFlow's one-step sample z - u(z, 0, 1) is x^ itself
    x_hat_1 = velocity(x, torch.ones(3), torch.zeros(3), y)
    torch.testing.assert_close(MeanFlow().sample(data, x, y, steps=1), x_hat_1)
    # and d/dt along the path's tangent goes through the division
    tx = torch.randn_like(x)
    _, tangent = torch.func.jvp(lambda x_, t_: data(x_, t_, r, y), (x, t), (tx, torch.ones_like(t)))
    _, dx_hat = torch.func.jvp(lambda x_, t_: velocity(x_, t_, r, y), (x, t), (tx, torch.ones_like(t)))
    t_ = t[:2].reshape(2, 1, 1, 1)
    expected = (tx[:2] - dx_hat[:2]) / t_ - (x[:2] - x_hat[:2]) / t_**2
    torch.testing.assert_close(tangent[:2], expected, rtol=1e-4, atol=1e-5)


def test_a_bounded_data_prediction_is_tanh_of_the_output_with_its_jvp():
    """bounded=True: x^ = tanh(output), inside [-1, 1] however large the output grows; the velocity and its JVP go
    through tanh (d tanh = (1 - x^^2) d output)."""
    plain = tiny_dit(time_inputs=2)
    plain.prediction = "data"
    bounded = copy.deepcopy(plain)
    bounded.bounded = True
    x, t, r, y = torch.randn(3, 3, 8, 8), torch.tensor([1.0, 0.5, 0.2]), torch.tensor([0.0, 0.2, 0.2]), torch.tensor([1, 2, 3])
    t_ = t.reshape(3, 1, 1, 1)
    x_hat = x - t_ * plain(x, t, r, y)
    torch.testing.assert_close(x - t_ * bounded(x, t, r, y), torch.tanh(x_hat), rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # an output far outside the data range stays inside it through tanh
        bounded.final_layer.linear.weight.mul_(1e3)
    assert (x - t_ * bounded(x, t, r, y)).abs().max() <= 1.0 + 1e-5
    bounded = copy.deepcopy(plain)
    bounded.bounded = True
    tx = torch.randn_like(x)
    _, dx_hat = torch.func.jvp(lambda x_, t_: x_ - t_.reshape(3, 1, 1, 1) * plain(x_, t_, r, y), (x, t), (tx, torch.ones_like(t)))
    _, tangent = torch.func.jvp(lambda x_, t_: bounded(x_, t_, r, y), (x, t), (tx, torch.ones_like(t)))
    b_hat = torch.tanh(x_hat)
    expected = (tx - (1 - b_hat**2) * dx_hat) / t_ - (x - b_hat) / t_**2
    torch.testing.assert_close(tangent, expected, rtol=1e-4, atol=1e-5)


def test_decoder_depth_config_is_checked():
    with pytest.raises(ValueError, match=r"model.decoder_depth must be in \[0, 2\] \(DiT-T/4 has 2 blocks\), got 5"):
        ModelConfig(name="DiT-T/4", decoder_depth=5)
    with pytest.raises(ValueError, match="model.decoder_depth=1 conditions the last blocks on r"):
        ModelConfig(name="DiT-T/4", decoder_depth=1, prediction="velocity").args(
            input_size=8, in_channels=3, num_classes=0, time_inputs=1
        )
    args = ModelConfig(name="DiT-T/4", decoder_depth=1, prediction="velocity").args(
        input_size=8, in_channels=3, num_classes=0, time_inputs=2
    )
    model = build_model(args.pop("name"), **args)
    assert model.decoder_depth == 1 and model.dt_embedder is None


def test_bounded_needs_the_data_prediction():
    with pytest.raises(ValueError, match="bounded=True squashes the clean-image prediction .* prediction='data'"):
        build_model("DiT-T/2", input_size=8, in_channels=3, bounded=True)
    config = ModelConfig(name="DiT-T/4", bounded=True).resolve_prediction(("velocity", "data"))
    with pytest.raises(ValueError, match="model.bounded=true .* predicts 'velocity'; add model.prediction=data"):
        config.args(input_size=8, in_channels=3, num_classes=0, time_inputs=1)
    args = ModelConfig(name="DiT-T/4", bounded=True, prediction="data").args(
        input_size=8, in_channels=3, num_classes=0, time_inputs=1
    )
    assert build_model(args.pop("name"), **args).bounded


@pytest.mark.parametrize(
    "build,call,match",
    [
        (dict(name="DiT-Q/2"), None, "unknown model size 'DiT-Q/2'; valid names: DiT-S/2"),
        (dict(input_size=9), None, "input_size 9 is not divisible by the patch size 2"),
        (dict(time_inputs=3), None, "time_inputs must be 1"),
        (dict(time_scale=0.0), None, "time_scale must be > 0"),
        (dict(prediction="x"), None, "unknown prediction 'x'; valid: velocity, data"),
        (dict(), dict(y=torch.tensor([0, 11])), r"labels y must lie in \[0, 10\]"),
        (dict(), dict(y=torch.tensor([-1, 0])), r"labels y must lie in \[0, 10\]"),
        (dict(num_classes=0), dict(y=torch.tensor([0, 1])), "unconditional model; build it with num_classes > 0"),
        (dict(), dict(x=torch.randn(2, 3, 16, 16)), r"expected \(B, 3, 8, 8\)"),
        (dict(), dict(r=torch.zeros(2)), "drop r or build it with time_inputs=2"),
        (dict(time_inputs=2), dict(), "pass r"),
        (dict(decoder_depth=1), None, "decoder_depth=1 conditions the last blocks on r, and this model takes t alone"),
        (dict(time_inputs=2, decoder_depth=3), None, r"decoder_depth must be an integer in \[0, 2\]"),
    ],
)
def test_bad_input(build, call, match):
    kwargs = dict(name="DiT-T/2", input_size=8, in_channels=3, num_classes=10) | build
    with pytest.raises(ValueError, match=match):
        model = build_model(kwargs.pop("name"), **kwargs)
        args = dict(x=torch.randn(2, 3, 8, 8), t=torch.rand(2)) | (call or {})
        model(**args)


# --------------------------------------------------------------------------------------------
# JVPs: the fused attention (CPU interpreter, fp32) against torch.func.jvp over math attention
# --------------------------------------------------------------------------------------------


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, tx = torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 3, 8, 8, generator=g)
    t, r = torch.tensor([0.3, 0.8]), torch.tensor([0.1, 0.8])
    return x, tx, t, r, torch.tensor([4, 10])


def test_cond_norm_makes_the_output_blind_to_the_embeddings_scale():
    """cond_norm divides the conditioning by its RMS: embedders whose outputs grow 1000-fold (sCM's exploding
    t_embedder at lr 1e-3) change nothing, where the plain DiT's modulations grow with them."""
    x, t, r, y = torch.randn(2, 3, 8, 8), torch.tensor([0.3, 0.7]), torch.tensor([0.1, 0.7]), torch.tensor([1, 2])
    for cond_norm in (True, False):
        model = tiny_dit(time_inputs=2, cond_norm=cond_norm)
        base = model(x, t, r, y)
        assert base.abs().mean() > 1e-3  # tiny_dit's weights are not DiT's zero init
        with torch.no_grad():
            for emb in (model.t_embedder, model.dt_embedder):
                emb.fc2.weight.mul_(1000.0)
                emb.fc2.bias.mul_(1000.0)
            model.y_embedder.weight.mul_(1000.0)
        grown = model(x, t, r, y)
        if cond_norm:
            torch.testing.assert_close(grown, base, rtol=1e-4, atol=1e-5)
        else:
            assert (grown - base).abs().mean() > 0.1 * base.abs().mean()


def _func_jvp(model, x, tx, t, r, y):
    return torch.func.jvp(lambda x_, t_: model(x_, t_, r, y), (x, t), (tx, torch.ones_like(t)))


@pytest.mark.parametrize("cond_norm,decoder_depth", [(False, 0), (True, 0), (False, 1)])
def test_dual_jvp_through_triton_matches_func_jvp_over_math(cond_norm, decoder_depth):
    model = tiny_dit(attention="triton_jvp", time_inputs=2, cond_norm=cond_norm, decoder_depth=decoder_depth)
    reference = with_backend(copy.deepcopy(model), "math")
    x, tx, t, r, y = _inputs()
    with plain_layers():  # reference: plain PyTorch ops and math attention, no custom rule at all
        out_ref, tout_ref = _func_jvp(reference, x, tx, t, r, y)
    assert tout_ref.abs().mean() > 1e-2  # a tangent worth comparing
    with forward_ad.dual_level():
        out = model(forward_ad.make_dual(x, tx), forward_ad.make_dual(t, torch.ones_like(t)), r, y)
        out, tout = forward_ad.unpack_dual(out)
    assert tout.grad_fn is None and out.grad_fn is not None
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tout, tout_ref, rtol=1e-4, atol=1e-5)
    # and under torch.func.jvp the fused kernel's jvp rule gives the same tangent
    _, tout_func = _func_jvp(model, x, tx, t, r, y)
    torch.testing.assert_close(tout_func, tout_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend,graph_free", [("triton_jvp", True), ("math", False)])
def test_dual_pass_saves_no_tangents(backend, graph_free):
    """No tensor saved for the backward carries a tangent, so the dual pass costs what a plain pass
    costs; math attention does save some, which shows the check can fail."""
    model = tiny_dit(attention=backend, size="DiT-T/4")
    x, tx, t, _, y = _inputs()
    saved_with_tangent = []

    def pack(tensor):
        saved_with_tangent.append(forward_ad.unpack_dual(tensor).tangent is not None)
        return tensor

    with forward_ad.dual_level(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(forward_ad.make_dual(x, tx), forward_ad.make_dual(t, torch.ones_like(t)), None, y)
        tout = forward_ad.unpack_dual(out).tangent
    assert saved_with_tangent and tout is not None
    assert (not any(saved_with_tangent)) == graph_free


def test_an_auto_prediction_resolves_to_the_teachers_else_the_objectives_first():
    auto = ModelConfig(name="DiT-T/4")
    assert auto.prediction == "auto"
    assert auto.resolve_prediction(("data", "velocity")).prediction == "data"  # MeanFlow
    assert auto.resolve_prediction(("velocity", "data")).prediction == "velocity"  # flow matching
    assert auto.resolve_prediction(("data", "velocity"), "velocity").prediction == "velocity"  # a velocity teacher's student
    assert auto.resolve_prediction(("velocity",), "data").prediction == "velocity"  # sCD: the teacher check names the mismatch
    assert ModelConfig(name="DiT-T/4", prediction="velocity").resolve_prediction(("data", "velocity")).prediction == "velocity"
    with pytest.raises(ValueError, match="model.prediction=auto has no network yet"):
        auto.args(input_size=8, in_channels=1, num_classes=0, time_inputs=1)
    with pytest.raises(ValueError, match="unknown prediction 'image'"):
        ModelConfig(name="DiT-T/4", prediction="image")


def test_the_velocity_head_shares_the_trunk():
    """head="both" is the output and the velocity head's output stacked on the channels, each as its own call gives
    it; the head is a separate layer (the output does not change when only the head's weights do)."""
    model = tiny_dit(velocity_head=True)
    x, t, y = torch.randn(2, 3, 8, 8), torch.rand(2), torch.tensor([1, 10])
    out, velocity = model(x, t, None, y), model(x, t, None, y, head="velocity")
    torch.testing.assert_close(model(x, t, None, y, head="both"), torch.cat([out, velocity], dim=1))
    assert velocity.shape == x.shape and not torch.allclose(out, velocity)
    with torch.no_grad():
        model.velocity_layer.linear.weight.add_(1.0)
    torch.testing.assert_close(model(x, t, None, y), out)
    assert "velocity_layer.linear.weight" not in tiny_dit().state_dict()


def test_velocity_head_bad_input():
    x, t = torch.randn(2, 3, 8, 8), torch.rand(2)
    with pytest.raises(ValueError, match="head must be 'output', or 'velocity' / 'both' on a model built with velocity_head"):
        tiny_dit()(x, t, head="velocity")
    with pytest.raises(ValueError, match="head must be"):
        tiny_dit(velocity_head=True)(x, t, head="F")
    with pytest.raises(ValueError, match="velocity_head=True is a second output .* build it with prediction='velocity'"):
        build_model("DiT-T/2", input_size=8, in_channels=3, prediction="data", velocity_head=True)


def test_attentions_output_gradient_arrives_in_qs_stride_order(monkeypatch):
    """The DiT's output projection sends dO back dense in q's stride order, the layout the fused backward feeds cuDNN:
    so under attention=auto SDPA's own cuDNN backward gets dO laid out as the fused one does, and PyTorch 2.11's cuDNN
    graph cache (keyed by q, k, v alone, holding its first call's O and dO strides) serves both right (README, attention
    backends). A DiT that consumed O otherwise would break that silently on Hopper."""
    seen = []

    def recording(q, k, v, **kw):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        o.register_hook(lambda g: seen.append((q, g)))
        return o

    monkeypatch.setattr(dit, "attention_fn", recording)
    model = build_model("DiT-T/2", input_size=8, in_channels=1, num_classes=5)
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([0, 3])
    model(x, t, y=y).square().sum().backward()
    assert len(seen) == len(model.blocks)
    for q, g in seen:
        assert stride_order(g) == stride_order(q)
        assert in_q_order(g, q) is g  # the feed copies nothing: SDPA's dO is the fused backward's


@pytest.mark.parametrize("decoder_depth,head", [(0, "output"), (1, "both")])
def test_the_adaln_modulations_in_one_matmul_are_each_layers_own(monkeypatch, decoder_depth, head):
    """DiT.forward computes the adaLN modulations of every block and head that read the same conditioning in one
    matmul (fnn.linears): the output, its tangent and every gradient are those of each layer's own call, in float64."""
    model = tiny_dit(time_inputs=2, decoder_depth=decoder_depth, velocity_head=True).double()
    own = copy.deepcopy(model)
    x, tx, t, r, y = (v.double() if v.is_floating_point() else v for v in _inputs())

    def run(m):
        with forward_ad.dual_level():
            out = m(forward_ad.make_dual(x, tx), forward_ad.make_dual(t, torch.ones_like(t)), r, y, head=head)
            out, tout = forward_ad.unpack_dual(out)
        out.square().sum().backward()
        return out, tout, {n: p.grad for n, p in m.named_parameters()}

    stacks = []
    linears = dit.fnn.linears
    monkeypatch.setattr(dit.fnn, "linears", lambda c, layers: stacks.append(len(layers)) or linears(c, layers))
    out, tout, grads = run(model)
    monkeypatch.setattr(dit.fnn, "linears", lambda c, layers: [layer(c) for layer in layers])
    out_own, tout_own, grads_own = run(own)
    depth = len(model.blocks)  # one stack of all blocks and heads; with a decoder, the encoder's and the decoder's
    assert stacks == ([depth + 1] if decoder_depth == 0 else [depth - decoder_depth, decoder_depth + 2])
    torch.testing.assert_close(out, out_own, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tout, tout_own, rtol=1e-12, atol=1e-12)
    unused = {name for name, g in grads.items() if g is None}  # the velocity head's, when only the output is asked for
    assert unused == {name for name, g in grads_own.items() if g is None}
    assert all(name.startswith("velocity_layer.") for name in unused) and len(unused) < len(grads) / 4
    for name in grads.keys() - unused:
        torch.testing.assert_close(grads[name], grads_own[name], rtol=1e-10, atol=1e-12, msg=name)


def test_sharded_modulations_are_each_blocks_own(monkeypatch):
    """FSDP2's block parameters are whole only inside the block's forward: with a sharded (DTensor) weight among
    them, the DiT stacks none and each block computes its own modulation."""
    model = tiny_dit()
    x, _, t, _, y = _inputs()
    expected = model(x, t, None, y)
    monkeypatch.setattr(dit.fnn, "linears", lambda c, layers: pytest.fail("stacked a sharded weight"))
    model.blocks[1].adaLN_modulation.weight.device_mesh = "mesh"  # what fnn.sharded looks for
    torch.testing.assert_close(model(x, t, None, y), expected, rtol=0, atol=0)
