"""The consistency curriculum's limit, shared by the MeanFlow and sCM tests: its gradient against the JVP target's."""

import torch

from tests.models.tiny import tiny_dit

ALPHAS = (0.5, 1e-3)


def gradient_distances(make_objective, time_inputs: int) -> dict[float, float]:
    """{alpha: relative L2 distance of the curriculum's gradient at alpha to the JVP target's} on one batch of a tiny
    DiT; make_objective(**curriculum_options) builds the objective (no options: the JVP target alone)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))

    def grad(**kwargs):
        model = tiny_dit(time_inputs=time_inputs, seed=1)
        torch.manual_seed(1)
        loss, _ = make_objective(**kwargs).loss(model, x, y, step=1000)
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])

    reference = grad()
    distances = {}
    for alpha in ALPHAS:
        g = grad(alpha_steps=[0, 2000], alpha_min=alpha**2)  # step 1000: alpha_min ** 0.5
        distances[alpha] = ((g - reference).norm() / reference.norm()).item()
    return distances
