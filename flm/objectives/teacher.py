"""A frozen flow-matching teacher for distillation (sCD, rCM, MeanFlow's teacher option), and the
conversion of a flow-matching velocity to TrigFlow's time variable.

    teacher = load_teacher("outputs/fm-run", student_args)          # the run's latest checkpoint, its EMA
    v = teacher_velocity(teacher, x_s, s, y, cfg_scale=2.0)          # no gradient; bf16 autocast on CUDA
    dxdt = trigflow_velocity(lambda x_s, s: v_fn(x_s, s), x_t, t, sigma_d)

Time conversion. Flow matching (flm's convention, flm.objectives.paths.LinearPath): x_s = (1 - s) x + s eps,
s in [0, 1], velocity v = eps - x. TrigFlow (sCM, flm.objectives.paths.TrigFlowPath): x_t = cos(t) x +
sin(t) sigma_d eps, t in [0, pi/2]. With the same x and eps both are one noisy image up to a scale:

    x_t = c(t) x_s,   c(t) = cos t + sigma_d sin t,   s(t) = sigma_d sin t / c(t)

(matching the coefficients: c (1 - s) = cos t of the data, c s = sigma_d sin t of the noise). From the
velocity at (x_s, s), x = x_s - s v and eps = x_s + (1 - s) v, so dx_t/dt = -sin(t) x + sigma_d cos(t) eps is

    dx_t/dt = sigma_d (v(x_t / c, s) + (cos t - sin t / sigma_d) x_t) / c.

Both sides are linear in (x, eps), so the exact flow-matching velocity E[eps - x | x_s] gives the exact
TrigFlow velocity E[dx_t/dt | x_t] (tests/objectives/test_distillation.py checks it on a Gaussian). sCM's
network output is F = dx_t/dt / sigma_d; its consistency function cos(t) x_t - sin(t) sigma_d F is then
x_s - s v, the flow-matching x-prediction.
"""

import torch
from torch import nn

from flm.objectives.guidance import guided
from flm.objectives.paths import LinearPath, bcast

# the model_args that the student and its teacher must share, and how an error names them
SHARED_ARGS = {
    "input_size": "image size",
    "in_channels": "channel count",
    "num_classes": "class count",
    "name": "model size",
    "time_scale": "time scale",
    "prediction": "prediction",
    "cond_norm": "conditioning norm (model.cond_norm)",
    "bounded": "bounded clean-image prediction (model.bounded)",
}


def flow_time(t: torch.Tensor, sigma_d: float) -> torch.Tensor:
    """The flow-matching time s(t) = sigma_d sin t / (cos t + sigma_d sin t) of TrigFlow time t."""
    return sigma_d * torch.sin(t) / (torch.cos(t) + sigma_d * torch.sin(t))


def trigflow_velocity(velocity, x_t: torch.Tensor, t: torch.Tensor, sigma_d: float) -> torch.Tensor:
    """TrigFlow's dx_t/dt at (x_t, t) from a flow-matching `velocity(x_s, s)` (the module docstring)."""
    cos_t, sin_t = bcast(torch.cos(t), x_t), bcast(torch.sin(t), x_t)
    c = cos_t + sigma_d * sin_t
    v = velocity(x_t / c, flow_time(t, sigma_d))
    return sigma_d * (v + (cos_t - sin_t / sigma_d) * x_t) / c


@torch.no_grad()
def teacher_velocity(teacher: nn.Module, x_s: torch.Tensor, s: torch.Tensor, y, cfg_scale: float = 1.0) -> torch.Tensor:
    """The teacher's velocity (its classifier-free guidance at cfg_scale), in float32; without gradient,
    and in bf16 autocast on CUDA whatever the run's precision. A null label gets the unguided null velocity."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x_s.is_cuda):
        return guided(teacher, x_s, s, None, y, cfg_scale).float()


def matmuls_in_bf16(network: nn.Module) -> nn.Module:
    """network with every linear layer's weight and bias stored in bf16, in place: for a frozen network that runs only
    under bf16 autocast (teacher_velocity, teacher_features on CUDA). There each linear casts its float32 weight and
    bias to bf16 at every loss (one kernel per tensor: ~130 a loss for DiT-S/2); stored so once, they are the same bf16
    values, so the outputs are the same to the bit, in half the memory. The embeddings stay float32: they are added in
    float32, outside autocast's matmuls."""
    for module in network.modules():
        if isinstance(module, nn.Linear):
            module.to(torch.bfloat16)
    return network


def teacher_features(teacher: nn.Module, x: torch.Tensor, s: torch.Tensor, eps: torch.Tensor, y, blocks) -> list:
    """The teacher's hidden states (B, N, D) after `blocks` at x_s = (1 - s) x + s eps (its forward's `features=`), in
    bf16 autocast on CUDA, with the gradient in x where x has one: the feature space of the adversarial heads and
    the perceptual term (flm.objectives.adversarial, MeanFlow's perceptual_weight)."""
    x_s = LinearPath().sample(x.float(), eps.float(), s).x_t
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
        return teacher(x_s, s, None, y, features=blocks)


def feature_blocks(depth: int, blocks, option: str) -> tuple[int, ...]:
    """The teacher's blocks to read: `blocks` checked against its depth, or by default four evenly spaced ones ending
    with the last (2, 5, 8, 11 of 12); a ValueError naming `option` otherwise."""
    if blocks is None:
        return tuple(sorted({max(0, depth * i // 4 - 1) for i in (1, 2, 3, 4)}))
    blocks = tuple(blocks)
    if not blocks or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth for i in blocks):
        raise ValueError(
            f"{option} must be block indices in [0, {depth}) of the teacher (a DiT of depth {depth}), "
            f"got {list(blocks)}; or null for four evenly spaced ones"
        )
    return blocks


def check_teacher(source: str, bundle: dict, student_args: dict) -> dict:
    """The teacher's model_args; a ValueError naming what is wrong when it is not a flow-matching
    checkpoint of a network like the student's."""
    from flm.models import complete_args
    from flm.train.config import plain  # flm.train imports flm.objectives

    objective = ((bundle.get("config") or {}).get("objective") or {}).get("name")
    if objective != "flow_matching":
        raise ValueError(
            f"teacher {source!r} was trained with objective {objective!r}, not flow_matching; distil a "
            f"flow-matching run (python train.py experiment=mnist_flow_matching)"
        )
    args, student_args = complete_args(plain(bundle["model_args"], f"{source}: model_args")), complete_args(student_args)
    diff = [
        f"{label} {args.get(k)!r} vs the student's {student_args.get(k)!r}"
        for k, label in SHARED_ARGS.items()
        if args.get(k) != student_args.get(k)
    ]
    if diff:
        raise ValueError(
            f"teacher {source!r} does not fit the student ({'; '.join(diff)}); the student starts from "
            f"the teacher's weights: pass the model=, data= and trainer.class_conditional options the "
            f"teacher was trained with (model={args.get('name')} model.prediction={args.get('prediction')})"
        )
    return args


def check_teacher_ema(ema):
    """objective.teacher_ema: None (the teacher run's first EMA), a decay in (0, 1) or an EMA's name ("sigma_rel0.05")."""
    if ema is None or (isinstance(ema, str) and ema) or (isinstance(ema, float) and 0 < ema < 1):
        return ema
    raise ValueError(
        f"teacher_ema must be null (the teacher run's first EMA), an EMA decay in (0, 1) such as 0.99, or an EMA's "
        f"name such as sigma_rel0.05, got {ema!r}"
    )


def load_teacher(path: str, student_args: dict, ema=None) -> nn.Module:
    """The flow-matching network of `path` (a run folder: its latest checkpoint; or a .pt file) with the weights of
    its EMA `ema` (check_teacher_ema; None: its first), built with the student's attention backend; checked against
    the student's build arguments (check_teacher)."""
    from flm.models import build_model
    from flm.train import checkpoint
    from flm.train.generator import generator_state

    source = checkpoint.find_checkpoint(str(path))  # FileNotFoundError naming the path
    bundle = checkpoint.load(source)
    args = check_teacher(source, bundle, student_args)
    teacher = build_model(**{**args, "attention": student_args.get("attention", "auto")})
    try:
        state = generator_state(bundle, "ema", ema=ema)
    except ValueError as err:
        if ema is None:  # a teacher without any EMA: nothing teacher_ema could name
            raise
        raise ValueError(f"teacher {source!r}: {err}; set objective.teacher_ema to one of them (null: the first)") from None
    teacher.load_state_dict(state)
    return teacher
