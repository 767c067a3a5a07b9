"""The generator a checkpoint holds, rebuilt from names and numbers: its network (EMA or raw weights)
and its objective (the sampler). Nothing in a checkpoint names a callable that gets called.

    bundle = checkpoint.load(checkpoint.find_checkpoint("outputs/2025-01-01/12-00-00"))
    model, objective = load_generator(bundle, weights="ema", device=device)
"""

import os
from collections.abc import Mapping, Sequence

import torch

from flm.models import build_model
from flm.objectives import OBJECTIVES, SCM, MeanFlow, Objective
from flm.train.config import objective_from_config, plain
from flm.train.ema import ema_key
from flm.typed import typed


def with_mid_t(section, mid_t, source: str):
    """The stored objective section with its few-step sampler's intermediate times replaced by `mid_t` (a
    number or a list of them): the 2-step time of sCM, its distilled students (sCD, rCM) and MeanFlow is a
    sampling choice."""
    name = section.get("name") if isinstance(section, Mapping) else None
    if not (name in OBJECTIVES and issubclass(OBJECTIVES[name], (SCM, MeanFlow))):
        raise ValueError(
            f"mid_t={mid_t} sets the intermediate times of few-step sampling (scm, scd, rcm in TrigFlow time; "
            f"meanflow, meanflow_distill in (0, 1)), but {source} is a {name} run, whose sampler has none; leave mid_t=null"
        )
    values = list(mid_t) if _listed(mid_t) else [mid_t]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"mid_t must be a number or a list of numbers (e.g. [1.1] for sCM, [0.6] for MeanFlow), got {mid_t!r}")
    return {**section, "mid_t": [float(v) for v in values]}


def with_gamma(section, gamma, source: str):
    """The stored objective section with its multi-step sampler's re-noising gamma replaced (TrigFlow runs:
    flm.objectives.consistency.SCM's gamma, a sampling choice)."""
    name = section.get("name") if isinstance(section, Mapping) else None
    if not (name in OBJECTIVES and issubclass(OBJECTIVES[name], SCM)):
        raise ValueError(
            f"gamma={gamma} sets how much fresh noise the multi-step sampler of a TrigFlow run (scm, scd, rcm) re-noises "
            f"with, but {source} is a {name} run, which does not re-noise; leave gamma=null"
        )
    if not (isinstance(gamma, (int, float)) and not isinstance(gamma, bool)):
        raise ValueError(f"gamma must be a number in [0, 1] (1: fresh noise, 0: none), got {gamma!r}")
    return {**section, "gamma": float(gamma)}


def sampler_variants(mid_t=None, gamma=None) -> list[tuple]:
    """The (mid_t, gamma) pairs a call scores: one pair, or a sweep when mid_t is a list of time lists
    ([[1.2], [1.1]]: one 2-step sampler each) or gamma a list of numbers ([1, 0.5]), every mid_t with every gamma.
    Values are checked where they are applied (with_mid_t, with_gamma)."""
    nested = [_listed(m) for m in mid_t] if _listed(mid_t) else []
    if any(nested) and not all(nested):
        raise ValueError(f"mid_t mixes times and lists of times ({mid_t!r}): pass [1.1] for one sampler, [[1.2],[1.1]] to sweep")
    mids = list(mid_t) if nested and all(nested) else [mid_t]
    gammas = list(gamma) if _listed(gamma) and gamma else [gamma]
    return [(m, g) for m in mids for g in gammas]


def _listed(value) -> bool:
    """A list of values (Hydra's included), not one value."""
    return isinstance(value, Sequence) and not isinstance(value, str)


def mid_t_tag(objective, mid_t, gamma=None) -> str:
    """The part of an output file name that says mid_t or gamma was set ("-mid0.8", "-gamma0"); "" when neither was."""
    tag = "" if mid_t is None else "-mid" + "_".join(f"{t:g}" for t in objective.mid_t)
    return tag + ("" if gamma is None else f"-gamma{objective.gamma:g}")


def build_objective_from(bundle: dict, source: str = "the checkpoint", mid_t=None, gamma=None) -> Objective:
    """The run's objective from the registry (flm.train.config: names and plain values only), with its saved
    state; `mid_t` and `gamma` (not None) replace its few-step sampler's intermediate times (with_mid_t) and
    re-noising (with_gamma)."""
    section = (bundle.get("config") or {}).get("objective")
    if mid_t is not None:
        section = with_mid_t(section, mid_t, source)
    if gamma is not None:
        section = with_gamma(section, gamma, source)
    objective = objective_from_config(section, where=source)
    if bundle.get("objective"):
        objective.load_state_dict(bundle["objective"])
    return objective


def ema_name(ema=None, ema_decay: float | None = None) -> str | None:
    """The EMA key asked for: `ema` by name ("0.9999", "sigma_rel0.05"; a number is a constant decay) or
    `ema_decay` (the older option); None: the run's first."""
    if ema is not None and ema_decay is not None:
        raise ValueError(f"ema={ema} and ema_decay={ema_decay} both given; pass one (ema names any EMA of the run)")
    if ema_decay is not None:
        return ema_key(ema_decay)
    if isinstance(ema, (int, float)) and not isinstance(ema, bool):
        return ema_key(ema)
    return None if ema is None else str(ema)


def generator_state(bundle: dict, weights: str = "ema", ema_decay: float | None = None, ema=None) -> dict:
    """The network weights to sample with: raw, or the EMA named `ema` / of `ema_decay` (default: the run's first)."""
    if weights not in ("ema", "raw"):
        raise ValueError(f"weights must be ema or raw, got {weights!r}")
    if weights == "raw":
        if "model" not in bundle:
            raise ValueError("weights=raw: an exported folder holds one EMA and no raw weights; pass weights=ema")
        return bundle["model"]
    averages = bundle["ema"]
    if not averages:
        raise ValueError("the run keeps no EMA (trainer.ema_decays=[] and trainer.ema_sigma_rels=[]); pass weights=raw")
    key = ema_name(ema, ema_decay) or next(iter(averages))
    if key not in averages:
        raise ValueError(f"ema={key} is not in the checkpoint; it has {', '.join(averages)}")
    return averages[key]


def sampler_steps(bundle: dict, objective: Objective, source: str) -> int:
    """The run's grid sampler steps: its trainer.sample_steps when set, else the objective's own."""
    steps = ((bundle.get("config") or {}).get("trainer") or {}).get("sample_steps")
    return objective.sample_steps if steps is None else typed(steps, int, f"{source}: trainer.sample_steps")


def load_generator(
    bundle: dict,
    *,
    weights: str = "ema",
    ema_decay: float | None = None,
    ema=None,
    attention: str = "auto",
    device="cpu",
    source: str = "the checkpoint",
    mid_t=None,
    gamma=None,
) -> tuple[torch.nn.Module, Objective]:
    """(model, objective) on `device`, the model in eval mode with the `attention` backend (sampling
    takes no JVP, and the run's training backend need not run on this machine); `mid_t`, `gamma` as
    build_objective_from's."""
    objective = build_objective_from(bundle, source, mid_t, gamma).to(device)
    model = build_model(**{**plain(bundle["model_args"], f"{source}: model_args"), "attention": attention})
    model.load_state_dict(generator_state(bundle, weights, ema_decay, ema))
    return model.to(device).eval(), objective


def open_generator(ckpt: str) -> tuple[dict, str]:
    """(bundle, its path) of a run folder, a checkpoint file or an exported folder (flm.train.export)."""
    from flm.train import checkpoint
    from flm.train.export import is_export, load_export

    if is_export(ckpt):
        return load_export(ckpt), os.path.abspath(ckpt)
    path = checkpoint.find_checkpoint(ckpt)
    return checkpoint.load(path), path


def output_base(path: str) -> tuple[str, str]:
    """(folder, stem) of what sample.py and evaluate.py write for `path`: a run's folder and the checkpoint's
    name, or an exported folder itself and "export"."""
    if os.path.isdir(path):
        return path, "export"
    return os.path.dirname(os.path.dirname(os.path.abspath(path))), os.path.splitext(os.path.basename(path))[0]
