"""Class conditioning shared by the objectives: label dropout for training and classifier-free
guidance (CFG) for sampling. The number of classes is read from the model (`model.num_classes`,
through DDP's `.module` and torch.compile's `._orig_mod`); the null class is index num_classes.

The guidance interval (Kynkaanniemi et al. 2024) guides only where the time lies in [t_min, t_max]
(each objective's own time: t in [0, 1] with 1 noise for flow matching and MeanFlow, TrigFlow's
t in [0, pi/2] for sCM); elsewhere the conditional output is used as it is.
"""

from collections.abc import Sequence

import torch


def unwrap(model):
    """The module under DDP / torch.compile wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def num_classes(model) -> int:
    return int(getattr(unwrap(model), "num_classes", 0))


def drop_labels(model, y: torch.Tensor | None, p: float) -> torch.Tensor | None:
    """Replace each label by the null class with probability p (CFG training)."""
    if y is None or p == 0.0:
        return y
    k = num_classes(model)
    if k == 0:
        raise ValueError("labels y were given but the model is unconditional; build it with num_classes > 0 or pass y=None")
    drop = torch.rand(y.shape, device=y.device) < p
    return torch.where(drop, torch.full_like(y, k), y)


def null_labels(model, y: torch.Tensor) -> torch.Tensor:
    return torch.full_like(y, num_classes(model))


def check_cfg(model, y, cfg_scale: float) -> None:
    if cfg_scale == 1.0:
        return
    if num_classes(model) == 0:
        raise ValueError(
            f"cfg_scale={cfg_scale} needs a class-conditional model but this one is unconditional; "
            "use cfg_scale=1.0 or build the model with num_classes > 0"
        )
    if y is None:
        raise ValueError(f"cfg_scale={cfg_scale} needs labels y; pass y or use cfg_scale=1.0")


def check_interval(interval, name: str = "cfg_interval") -> tuple[float, float] | None:
    """[t_min, t_max] as a tuple of floats (None: guidance at every time)."""
    if interval is None:
        return None
    values = list(interval) if isinstance(interval, Sequence) and not isinstance(interval, str) else [interval]
    if (
        len(values) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        or not values[0] <= values[1]
    ):
        raise ValueError(f"{name} must be [t_min, t_max] with t_min <= t_max (null: every time), got {interval!r}")
    return float(values[0]), float(values[1])


def in_interval(t: torch.Tensor, interval: tuple[float, float] | None) -> torch.Tensor:
    """Per sample: is t in [t_min, t_max] (all true without an interval)."""
    if interval is None:
        return torch.ones_like(t, dtype=torch.bool)
    return (t >= interval[0]) & (t <= interval[1])


def guided(model, x, t, r, y, cfg_scale: float, interval: tuple[float, float] | None = None) -> torch.Tensor:
    """model(x, t, r, y) with classifier-free guidance: null + cfg_scale * (cond - null), one batch; with an
    `interval`, only for the samples whose t lies in it (the others get cond, and a batch with none inside
    costs one evaluation: the check reads t on the host, so this is for samplers, not a captured step)."""
    if cfg_scale == 1.0:
        return model(x, t, r, y)
    inside = None if interval is None else in_interval(t, interval)
    if inside is not None and not inside.any():
        return model(x, t, r, y)
    cat = lambda a: None if a is None else torch.cat([a, a])  # noqa: E731
    out = model(cat(x), cat(t), cat(r), torch.cat([y, null_labels(model, y)]))
    cond, uncond = out.chunk(2)
    out = uncond + cfg_scale * (cond - uncond)
    if inside is None or inside.all():
        return out
    return torch.where(inside.view(-1, *[1] * (out.dim() - 1)), out, cond)
