"""build_objective, the objectives' common interface, and bad input.

python -m pytest tests/objectives/test_api.py -q
"""

import pytest
import torch

from flm.objectives import SCM, FlowMatching, MeanFlow, build_objective
from tests.objectives.toys import PointMassVelocity


def test_build_and_interface():
    assert isinstance(build_objective("flow_matching"), FlowMatching)
    assert build_objective("meanflow", jvp_mode="two_pass").jvp_mode == "two_pass"
    assert [build_objective(n).time_inputs for n in ("flow_matching", "meanflow", "scm")] == [1, 2, 1]
    # only sCM has parameters (its adaptive weighting): the optimizer must see them
    assert not list(FlowMatching().parameters()) and not list(MeanFlow().parameters())
    assert list(SCM().parameters())


def test_scm_state_roundtrip():
    a, b = SCM(), SCM()
    with torch.no_grad():
        a.logvar.linear.bias.fill_(0.5)
    b.load_state_dict(a.state_dict())
    t = torch.rand(3)
    torch.testing.assert_close(b.logvar(t), a.logvar(t))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: build_objective("ddpm"), "unknown objective 'ddpm'; valid names: flow_matching, meanflow, scm"),
        (lambda: MeanFlow(jvp_mode="forward"), "unknown jvp_mode 'forward'; valid modes: dual, two_pass, func"),
        (lambda: SCM(jvp_mode="x"), "unknown jvp_mode 'x'"),
        (lambda: FlowMatching(label_dropout=-0.1), r"label_dropout must be a probability in \[0, 1\], got -0.1"),
        (lambda: MeanFlow(r_neq_t=1.5), r"r_neq_t must be a probability in \[0, 1\], got 1.5"),
        (lambda: SCM(label_dropout=2.0), "label_dropout must be a probability"),
        (lambda: FlowMatching(sampler="rk4"), "unknown sampler 'rk4'; valid samplers: euler, heun"),
        (lambda: FlowMatching(t_std=0.0), "t_std must be > 0"),
        (lambda: MeanFlow(cfg_omega=0.0), "guidance in training needs cfg_omega > 0"),
        (lambda: SCM(warmup_steps=-1), "warmup_steps must be >= 0"),
        (lambda: SCM(mid_t=(2.0,)), r"mid_t values must lie in \(0, t_max"),
    ],
)
def test_bad_constructor_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("objective", [FlowMatching(), MeanFlow(), SCM()], ids=["fm", "meanflow", "scm"])
def test_bad_sampling_and_training_input(objective):
    model, noise = PointMassVelocity(), torch.randn(2, 1, 2, 2)
    with pytest.raises(ValueError, match="cfg_scale=2.0 needs a class-conditional model but this one is unconditional"):
        objective.sample(model, noise, torch.tensor([0, 1]), steps=1, cfg_scale=2.0)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        objective.sample(model, noise, steps=0)
    with pytest.raises(ValueError, match="labels y were given but the model is unconditional"):
        objective.loss(model, noise, torch.tensor([0, 1]))


def test_guidance_needs_labels():
    model = PointMassVelocity()
    model.num_classes = 3
    with pytest.raises(ValueError, match="needs labels y"):
        FlowMatching().sample(model, torch.randn(2, 1, 2, 2), steps=1, cfg_scale=1.5)
    with pytest.raises(ValueError, match="guidance in training .* needs a class-conditional model and labels"):
        MeanFlow(cfg_omega=2.0).loss(model, torch.randn(2, 1, 2, 2))
