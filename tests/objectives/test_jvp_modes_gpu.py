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
