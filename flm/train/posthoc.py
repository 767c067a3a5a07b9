"""Post-hoc EMA (EDM2, Karras et al. 2024): the weights of a power-function EMA of any width sigma_rel, put together
after training from the power EMAs a run saved along the way (trainer.ema_sigma_rels, in checkpoints that were kept),
with no retraining.

A power EMA of exponent gamma read after t updates weighs the weights of update tau by a density close to

    p(tau; t, gamma) = (gamma + 1) tau^gamma / t^(gamma + 1)   on [0, t].

Each saved EMA (a snapshot: its step t_i and gamma_i) is such a profile. The target profile (t_r, gamma_r) is fitted
as sum_i x_i p_i by least squares in L2 over tau, whose inner products have a closed form (profile_dot), and the
target's weights are then sum_i x_i theta_i.

    coefficients, fit = posthoc_coefficients([(500, 6.94), (500, 3.46), (1000, 6.94), (1000, 3.46)],
                                             (1000, sigma_rel_to_gamma(0.07)))
    bundle, keys = posthoc_bundle("runs/mnist_scd", [0.05, 0.07])    # export.py ckpt=RUN sigma_rel=0.07 writes one out
"""

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from flm.train import checkpoint
from flm.train.ema import POWER_PREFIX, gamma_to_sigma_rel, sigma_rel_to_gamma


def profile_dot(t_a: float, gamma_a: float, t_b: float, gamma_b: float) -> float:
    """The L2 inner product of two power profiles over tau: (ga + 1)(gb + 1) m^(ga + gb + 1) / ((ga + gb + 1)
    t_a^(ga + 1) t_b^(gb + 1)), m = min(t_a, t_b); in logarithms, since t^gamma overflows at long runs and narrow
    widths."""
    g = gamma_a + gamma_b + 1
    log = math.log(gamma_a + 1) + math.log(gamma_b + 1) - math.log(g) + g * math.log(min(t_a, t_b))
    return math.exp(log - (gamma_a + 1) * math.log(t_a) - (gamma_b + 1) * math.log(t_b))


def posthoc_coefficients(snapshots, target) -> tuple[np.ndarray, float]:
    """(x, fit error): the least-squares weights of the snapshots' profiles for the target profile, and the fit's
    relative L2 error ||sum_i x_i p_i - p_r|| / ||p_r|| (0: exact; a few percent: the snapshots span it well).

    snapshots: (step, gamma) of each saved power EMA; target: (step, gamma)."""
    scale = max(float(t) for t, _ in snapshots)  # times relative to the last snapshot: the same fit, better conditioned
    snapshots = [(float(t) / scale, float(g)) for t, g in snapshots]
    t_r, g_r = float(target[0]) / scale, float(target[1])
    gram = np.array([[profile_dot(ta, ga, tb, gb) for tb, gb in snapshots] for ta, ga in snapshots])
    b = np.array([profile_dot(t, g, t_r, g_r) for t, g in snapshots])
    x = np.linalg.lstsq(gram, b, rcond=None)[0]
    norm = profile_dot(t_r, g_r, t_r, g_r)
    residual = max(float(x @ gram @ x - 2 * x @ b + norm), 0.0)
    return x, math.sqrt(residual / norm)


def check_target(sigma_rel) -> float:
    """gamma of a target width, or a clear error."""
    if isinstance(sigma_rel, bool) or not isinstance(sigma_rel, (int, float)) or not 0 < sigma_rel < gamma_to_sigma_rel(0.0):
        raise ValueError(f"sigma_rel must be a number in (0, 0.288) (a power EMA's relative width, e.g. 0.05), got {sigma_rel!r}")
    return sigma_rel_to_gamma(float(sigma_rel))


def widths_of(sigma_rel) -> list | float:
    """A command line's sigma_rel: a list of widths (Hydra's ListConfig included) as a list, a single value as it is."""
    return list(sigma_rel) if isinstance(sigma_rel, Sequence) and not isinstance(sigma_rel, str) else sigma_rel


def run_of(checkpoint_path: str) -> str:
    """The run folder of a checkpoint file (RUN/checkpoints/ckpt-*.pt)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(checkpoint_path)))


def posthoc_key(sigma_rel: float) -> str:
    return f"posthoc_{POWER_PREFIX}{sigma_rel:g}"


def power_emas(bundle: dict) -> list[tuple[str, float]]:
    """(key, gamma) of each power EMA a checkpoint holds."""
    keys = [k for k in bundle.get("ema") or {} if k.startswith(POWER_PREFIX)]
    return [(k, sigma_rel_to_gamma(float(k[len(POWER_PREFIX) :]))) for k in keys]


def _buffer_names(bundle: dict) -> set[str]:
    """The model's buffers, which an EMA copies rather than averages: taken from the last snapshot, not combined."""
    from flm.models import build_model
    from flm.train.config import plain

    with torch.device("meta"):
        model = build_model(**plain(bundle["model_args"], "the checkpoint: model_args"))
    return {name for name, _ in model.named_buffers()}


def posthoc_bundle(run_dir: str, sigma_rels, step: int | None = None, log=print) -> tuple[dict, list[str]]:
    """(bundle, keys): the checkpoint at the target step (default the run's last) with one more EMA per width in
    `sigma_rels` (a number or a list), each the power EMA of that width put together from the run's saved power EMAs
    at or before that step. The steps come from the checkpoints' names and the power EMAs from the target's (a run
    keeps one set of EMAs: a resume refuses another), so each checkpoint is read once, for all widths together; the
    weights are summed in float64, the model's buffers taken from the target checkpoint."""
    widths = widths_of(sigma_rels)
    widths = widths if isinstance(widths, list) else [widths]
    if not widths:
        raise ValueError("sigma_rel is an empty list; pass a width (0.07) or a list of them ([0.05,0.07])")
    gammas = [check_target(w) for w in widths]
    paths = checkpoint.list_checkpoints(run_dir)
    if not paths:
        raise FileNotFoundError(f"no checkpoint in {run_dir!r}; post-hoc EMA reads a run folder's checkpoints/")
    steps = [checkpoint.step_of(p) for p in paths]
    step = steps[-1] if step is None else step
    if isinstance(step, bool) or step not in steps:
        raise ValueError(f"step={step!r} is not a saved checkpoint's step; the run has {steps}")
    paths = [p for p, s in zip(paths, steps) if s <= step]
    last = checkpoint.load(paths[-1])
    # (path, key, step, gamma) of every saved power EMA
    found = [(path, key, checkpoint.step_of(path), g) for path in paths for key, g in power_emas(last)]
    if len(found) < 2:
        raise ValueError(
            f"{run_dir!r} holds {len(found)} power EMA snapshot(s) up to step {step}; post-hoc EMA needs two or more: "
            f"train with trainer.ema_sigma_rels=[0.05,0.1] and keep checkpoints along the run (trainer.ckpt_every=N "
            f"trainer.keep_last=0)"
        )
    fits = [posthoc_coefficients([(t, g) for _, _, t, g in found], (step, gamma)) for gamma in gammas]
    buffers, totals = _buffer_names(last), [{} for _ in widths]
    for path in paths:
        bundle = last if path == paths[-1] else checkpoint.load(path)
        for i, (p, key, _, _) in enumerate(found):
            if p != path:
                continue
            for name, value in bundle["ema"][key].items():
                if name in buffers or not value.is_floating_point():
                    continue
                for total, (x, _) in zip(totals, fits):
                    total.setdefault(name, torch.zeros(value.shape, dtype=torch.float64)).add_(value.double(), alpha=float(x[i]))
    reference, averages = last["ema"][found[-1][1]], {}
    for width, gamma, total, (_, fit) in zip(widths, gammas, totals, fits):
        key = posthoc_key(float(width))
        averages[key] = {n: total[n].to(v.dtype) if n in total else v.clone() for n, v in reference.items()}
        log(
            f"post-hoc EMA sigma_rel {float(width):g} (gamma {gamma:.3f}) at step {step} from {len(found)} snapshots "
            f"({', '.join(sorted({k for _, k, _, _ in found}))} at steps {sorted({t for _, _, t, _ in found})}); "
            f"relative error of its fitted profile {fit:.2%}"
        )
    return {**last, "ema": {**last["ema"], **averages}}, list(averages)
