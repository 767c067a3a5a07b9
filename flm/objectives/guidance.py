"""Class conditioning shared by the objectives: label dropout for training and classifier-free
guidance (CFG) for sampling. The number of classes is read from the model (`model.num_classes`,
through DDP's `.module` and torch.compile's `._orig_mod`); the null class is index num_classes.
"""

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


def guided(model, x, t, r, y, cfg_scale: float) -> torch.Tensor:
    """model(x, t, r, y) with classifier-free guidance: null + cfg_scale * (cond - null), one batch."""
    if cfg_scale == 1.0:
        return model(x, t, r, y)
    cat = lambda a: None if a is None else torch.cat([a, a])  # noqa: E731
    out = model(cat(x), cat(t), cat(r), torch.cat([y, null_labels(model, y)]))
    cond, uncond = out.chunk(2)
    return uncond + cfg_scale * (cond - uncond)
