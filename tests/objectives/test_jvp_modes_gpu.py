"""On a CUDA GPU, bf16 autocast: a MeanFlow / sCM step through the fused attention at head dim 72
(DiT-XL's) gives the gradients of math attention in two passes.

    python -m pytest tests/objectives/test_jvp_modes_gpu.py -q     # needs CUDA
"""

import copy

import pytest
import torch

from flm.models.dit import DiT
from flm.objectives import build_objective
from tests.models.tiny import with_backend

pytestmark = pytest.mark.gpu


def _grads(objective_name, model, backend, mode):
    objective = build_objective(objective_name, jvp_mode=mode).cuda()
    model = with_backend(copy.deepcopy(model), backend)
    g = torch.Generator("cuda").manual_seed(0)
    x, y = torch.randn(8, 4, 16, 16, device="cuda", generator=g), torch.arange(8, device="cuda")
    torch.manual_seed(1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = objective.loss(model, x, y, step=10**6)
    return torch.cat([p.flatten() for p in torch.autograd.grad(loss, list(model.parameters()))])


@pytest.mark.parametrize("objective_name", ["meanflow", "scm"])
def test_fused_bf16_step_matches_math_at_head_dim_72(objective_name):
    torch.manual_seed(0)
    model = DiT(
        input_size=16,
        in_channels=4,
        patch_size=2,
        hidden_size=144,
        depth=2,
        num_heads=2,
        num_classes=10,
        time_inputs=2 if objective_name == "meanflow" else 1,
        attention="math",
    ).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    ref = _grads(objective_name, model, "math", "two_pass")
    for mode in ("dual", "two_pass", "func"):
        got = _grads(objective_name, model, "triton_jvp", mode)
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel < 2e-2, f"{objective_name} {mode}: relative gradient error {rel:.2e}"


@pytest.mark.parametrize(
    "objective_name, options",
    [
        ("flow_matching", {}),
        ("meanflow", {}),
        ("meanflow", {"alpha_steps": [0, 10]}),
        ("scm", {}),
        ("scm", {"alpha_steps": [0, 10]}),
    ],
)
def test_every_metric_lives_on_the_gpu(objective_name, options):
    """The loop all-reduces the objective's metrics over ranks, and NCCL takes no CPU tensor: each one on the batch's
    device (the curriculum's alpha is a Python number in an eager step)."""
    from tests.models.tiny import tiny_dit

    objective = build_objective(objective_name, **options).cuda()
    model = tiny_dit(time_inputs=objective.time_inputs, channels=4, input_size=16).cuda()
    x, y = torch.randn(4, 4, 16, 16, device="cuda"), torch.arange(4, device="cuda")
    _, metrics = objective.loss(model, x, y, step=3)
    assert {k: v.device.type for k, v in metrics.items()} == dict.fromkeys(metrics, "cuda")
