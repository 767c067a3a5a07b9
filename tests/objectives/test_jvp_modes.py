"""One training step of a tiny DiT: the same loss and gradients in both JVP modes and with the
fused attention (CPU interpreter, fp32) as a reference made of plain PyTorch ops (no flm.nn rule)
with math attention.

    python -m pytest tests/objectives/test_jvp_modes.py -q
"""

import contextlib
import copy

import pytest
import torch

from flm.objectives import build_objective
from tests.models.tiny import plain_layers, tiny_dit, with_backend

SETUPS = [(backend, mode) for backend in ("math", "triton_jvp") for mode in ("dual", "two_pass", "func")]


def _step(objective_name, model, backend, jvp_mode, plain=False, options=None):
    options = options or ({"warmup_steps": 4} if objective_name == "scm" else {})
    objective = build_objective(objective_name, jvp_mode=jvp_mode, **options)
    model = with_backend(copy.deepcopy(model), backend)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.tensor([0, 3, 7, 9])
    torch.manual_seed(1)  # same t, r, noise and label dropout for every setup
    with plain_layers() if plain else contextlib.nullcontext():
        loss, _ = objective.loss(model, x, y, step=2)
    params = list(model.parameters()) + list(objective.parameters())
    return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize(
    ("objective_name", "options", "prediction"),
    [
        ("meanflow", None, "velocity"),
        ("meanflow", {"identity": "lagrangian", "tangent": "sample", "cfg_omega": 1.0, "adaptive_p": 0.25}, "velocity"),
        ("scm", None, "velocity"),
        ("meanflow", None, "data"),  # d/dt through the data prediction's division by t
        ("scm", None, "data"),  # and through sCM's F built from it (1 / sin t)
        ("meanflow", {"tangent": "model", "target_velocity": "model", "adaptive_p": 0.25}, "data"),
    ],
    # the Lagrangian identity's JVP is along r alone
    ids=["meanflow", "meanflow-lagrangian", "scm", "meanflow-data", "scm-data", "meanflow-self"],
)
def test_gradients_agree_across_modes_and_backends(objective_name, options, prediction):
    model = tiny_dit(time_inputs=2 if objective_name == "meanflow" else 1)
    model.prediction = prediction
    loss_ref, grads_ref = _step(objective_name, model, "math", "two_pass", plain=True, options=options)
    assert sum(g.norm() for g in grads_ref if g is not None) > 1e-2
    for backend, mode in SETUPS:
        loss, grads = _step(objective_name, model, backend, mode, options=options)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-6)
        for g, g_ref in zip(grads, grads_ref):
            assert (g is None) == (g_ref is None)
            if g is not None:
                torch.testing.assert_close(g, g_ref, rtol=1e-3, atol=1e-5, msg=f"{backend}/{mode}")
