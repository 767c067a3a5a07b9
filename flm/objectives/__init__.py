"""Objectives by name; each owns its loss and its sampler (the trainer knows neither). The interface
the loop relies on is written down in flm.objectives.protocol (Objective, Network).

    from flm.objectives import build_objective
    objective = build_objective("meanflow", jvp_mode="dual").to(device)
    model = build_model(..., time_inputs=objective.time_inputs)
    opt = torch.optim.AdamW(list(model.parameters()) + list(objective.parameters()))  # sCM has some
    loss, metrics = objective.loss(model, x, y, step=step)
    x = objective.sample(model, noise, y, steps=1, cfg_scale=1.0)

Every objective is an nn.Module (parameters: only sCM's adaptive weighting; state_dict for the
checkpoint) with `time_inputs` (1, or 2 for MeanFlow's (t, r)), `sample_steps` (its sampler's default),
`predictions` (what its model may predict: flm.models.PREDICTIONS, the velocity or the clean image),
`networks` (what it needs besides the model: the distilled students' teacher and fake score, flm.objectives.distillation
and flm.objectives.dmd),
`loss(model, x, y=None, *, step=0) -> (loss, metrics)` (step: an int, or a 0-dim tensor on the device
when the step is a CUDA graph) and `sample(model, noise, y=None, *, steps, cfg_scale=1.0, generators=None) -> x`;
`generators` (one torch.Generator per image) feed any noise a sampler draws after `noise` (sCM's
multi-step re-noising), so samples do not depend on the batch size; deterministic samplers draw none.
"""

from flm.objectives.consistency import SCM
from flm.objectives.distillation import RCM, RCMGAN, SCD
from flm.objectives.flow_matching import FlowMatching
from flm.objectives.jvp import JVP_MODES
from flm.objectives.meanflow import MeanFlow, MeanFlowDMD, MeanFlowGAN
from flm.objectives.protocol import NO_NETWORKS, Network, Objective

OBJECTIVES = {
    "flow_matching": FlowMatching,
    "meanflow": MeanFlow,
    "scm": SCM,
    "scd": SCD,
    "rcm": RCM,
    "meanflow_dmd": MeanFlowDMD,
    "meanflow_gan": MeanFlowGAN,
    "rcm_gan": RCMGAN,
}


def build_objective(name: str, **kwargs) -> Objective:
    """The objective `name` (a key of OBJECTIVES) built with keyword arguments."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid names: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](**kwargs)


__all__ = [
    "JVP_MODES",
    "NO_NETWORKS",
    "OBJECTIVES",
    "RCM",
    "RCMGAN",
    "SCD",
    "SCM",
    "FlowMatching",
    "MeanFlow",
    "MeanFlowDMD",
    "MeanFlowGAN",
    "Network",
    "Objective",
    "build_objective",
]
