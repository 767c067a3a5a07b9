"""Attention backends side by side: the same training run with each, checked against `math`.

    python ablate.py                                           # DiT-Ti/7 MeanFlow, shipped MNIST, 50 steps
    python ablate.py model=DiT-B/2 objective=meanflow ablate.tokens=1024 trainer.batch_size=32 \\
        trainer.max_steps=100 run_dir=ablations/dit-b2-meanflow-1024
    python ablate.py objective=flow_matching ablate.backends=[math,sdpa] trainer.precision=fp32

Composed from configs/ablate.yaml: configs/train.yaml plus an `ablate:` section, so every train.py
option works (model=, objective=, data=, trainer.batch_size=, trainer.max_steps=, trainer.seed=). Each
backend trains through flm.train.train from the same seed (same initial weights, batches and noise)
into run_dir/<backend>/ (metrics.jsonl, samples; the checkpoints are deleted). Compared with `math`:
the loss curve (|mean - mean_math| / mean_math over the last quarter of the steps, flagged beyond the
tolerance and beyond 3 standard errors of the per-step scatter; the curve is the objective's mse where
it logs one, since MeanFlow's adaptive-weighted loss stays near 1), and the relative L2
error of the gradient and, for MeanFlow and sCM, of the objective's JVP tangent (du/dt) in one loss
evaluation on the first batch at math's final weights, the same for every backend (see probe()). A
backend beyond a tolerance is flagged; one that cannot run here is a "skipped: <reason>" row.
Writes run_dir/ablation.md (table), ablation.png (time and memory per backend, loss curves) and
ablation.json (the numbers).
"""

import copy
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
from collections.abc import Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from flm import dist
from flm.attention import BACKENDS
from flm.data import DataConfig, Loader
from flm.log import read_metrics
from flm.models import MODEL_SIZES, build_model
from flm.objectives.jvp import record_tangents
from flm.train import checkpoint, train
from flm.cli import user_error
from flm.train.config import build_group
from flm.train.ema import ema_key
from flm.train.settings import amp_dtype, local_batch_size

# Default tolerances by compute precision: (loss, grad, tangent).
TOLERANCES = {"bf16": (5e-2, 1e-2, 1e-2), "fp32": (1e-3, 1e-4, 1e-4)}


# ----------------------------------------------------------------------------------------------
# Data at a given token count
# ----------------------------------------------------------------------------------------------


def data_at(cfg: DictConfig, side: int | None) -> DataConfig:
    """The run's data, resized to side x side (None: as it is)."""
    data = build_group(cfg, "data")
    return data if side is None else dataclasses.replace(data, resolution=side)


def image_side(model: str, tokens: int | None) -> int | None:
    """The image side that gives `tokens` patches with the model's patch size."""
    if tokens is None:
        return None
    patch = MODEL_SIZES[model][3]
    if tokens <= 0 or math.isqrt(tokens) ** 2 != tokens:
        raise ValueError(
            f"ablate.tokens must be a square number (the image is a square grid of patches), got {tokens}; e.g. 256, 1024 or 4096"
        )
    return patch * math.isqrt(tokens)


# ----------------------------------------------------------------------------------------------
# One training run per backend
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    backend: str
    skipped: str | None = None  # why it could not run here
    curve: str = "loss"  # the metric in `losses`: mse where the objective logs it, else loss
    losses: list[float] = dataclasses.field(default_factory=list)  # one per step
    step_ms: float | None = None  # median after the warm-up steps; with repeats, the median of the runs' medians
    step_ms_runs: list[float] = dataclasses.field(default_factory=list)  # each run's median, in the order they ran
    steps: str | None = None  # how the timed steps ran (trainer.cuda_graph): "CUDA graph", "eager" or "mixed"
    images_per_s: float | None = None
    peak_gib: float | None = None  # CUDA only
    grads: dict[str, torch.Tensor] | None = None  # from probe(), float32 on the CPU
    tangent: torch.Tensor | None = None  # the objective's JVP tangent, from probe()
    diffs: dict[str, float] = dataclasses.field(default_factory=dict)  # loss / grad / tangent vs math
    loss_noise: float = 0.0  # standard error of diffs["loss"] (per-step scatter of the two curves)
    drift: list[str] = dataclasses.field(default_factory=list)  # the diffs beyond their tolerance


@dataclasses.dataclass
class Trained:
    """What probe() needs of a finished run: the model's arguments and the weights it ended with, with those of the
    objective's trainable networks (a distillation's fake score or discriminator) and its EMAs (a target network)."""

    model_args: dict
    model: dict[str, torch.Tensor]
    objective: dict[str, torch.Tensor]
    networks: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    ema: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)


def train_with(
    cfg: DictConfig, backend: str, run_dir: str, side: int | None, warmup: int, keep_weights: bool
) -> tuple[Result, Trained | None]:
    """Train with `backend` into run_dir; a backend that cannot run here (or runs out of memory) is skipped."""
    cfg = copy.deepcopy(cfg)
    cfg.model.attention = backend
    try:
        objective = build_group(cfg, "objective")  # kept: its networks name the trainable ones in the checkpoint
        train(
            run_dir=run_dir,
            model=build_group(cfg, "model"),
            objective=objective,
            data=data_at(cfg, side),
            optim=build_group(cfg, "optim"),
            trainer=build_group(cfg, "trainer"),
            logger=build_group(cfg, "logger"),
            config=OmegaConf.to_container(cfg, resolve=True),
        )
    except Exception as e:
        out_of_memory = isinstance(e, torch.cuda.OutOfMemoryError)
        cause = user_error(e)
        if cause is None and not out_of_memory:
            raise
        shutil.rmtree(run_dir, ignore_errors=True)
        return Result(backend, skipped="out of memory" if out_of_memory else str(cause).splitlines()[0]), None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    trained = None
    if keep_weights:  # the final checkpoint: the weights probe() starts from
        bundle = checkpoint.load(checkpoint.find_checkpoint(run_dir))
        networks = {name: bundle[name] for name, network in objective.networks.items() if network.trainable}
        trained = Trained(bundle["model_args"], bundle["model"], bundle["objective"], networks, bundle.get("ema") or {})
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)  # weights are not what we compare

    records = read_metrics(run_dir)
    # MeanFlow's adaptive-weighted loss stays near 1; an alternating objective (rCM) logs its student's mse in the
    # student's steps alone
    curve = "mse" if any("mse" in r for r in records) else "loss"
    median_ms = statistics.median([r["step_ms"] for r in records][warmup:] or [r["step_ms"] for r in records])
    result = Result(
        backend,
        curve=curve,
        losses=[float(r[curve]) for r in records if curve in r],
        step_ms=median_ms,
        step_ms_runs=[median_ms],
        steps=how_steps_ran(records),
        images_per_s=cfg.trainer.batch_size * 1000 / median_ms,
        peak_gib=max((r["gpu_mem_gib"] for r in records if "gpu_mem_gib" in r), default=None),
    )
    return result, trained


def time_again(cfg: DictConfig, results: list[Result], run_dir: str, side: int | None, warmup: int, repeats: int) -> None:
    """Train every backend of `results` repeats - 1 more times, in reversed order each round (math, sdpa, triton_jvp,
    then triton_jvp, sdpa, math, ...), and give each the median of its runs' step times: one after the other, the
    backends' runs meet a host whose speed drifts (20 % between two calls on an H100, docs/train_step.md Run Q); over an
    even number of rounds the alternating order gives every backend the same mean position, so a drift linear in time
    favours none (with two runs the median is their mean). Only the timing is taken from the repeats; their folders
    keep metrics.jsonl (run_dir/repeats/<backend>-<round>)."""
    order = list(results)
    for round_ in range(2, repeats + 1):
        order.reverse()
        for result in order:
            dist.info0(f"ablation: {result.backend}, timing run {round_} of {repeats}")
            again, _ = train_with(
                cfg,
                result.backend,
                os.path.join(run_dir, "repeats", f"{result.backend}-{round_}"),
                side,
                warmup,
                keep_weights=False,
            )
            if again.skipped:  # out of memory this time: the runs that did run still time it
                dist.info0(f"ablation: {result.backend}'s timing run {round_} skipped ({again.skipped})")
                continue
            result.step_ms_runs.append(again.step_ms)
    for result in results:
        result.step_ms = statistics.median(result.step_ms_runs)
        result.images_per_s = cfg.trainer.batch_size * 1000 / result.step_ms


def probe(
    cfg: DictConfig, backend: str, trained: Trained, dataset, device: torch.device, dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Gradients and JVP tangent of one loss with `backend` at math's final weights, on the first batch.

    Every backend gets the same weights, batch and noise, so the differences are the backend's alone.
    (Not at the initial weights: DiT's zero-initialised gates and output layer keep attention out of
    the first steps' output and gradients.)
    """
    model_args = {**trained.model_args, "attention": backend}
    model = build_model(**model_args)
    model.load_state_dict(trained.model)
    model.to(device)
    objective = build_group(cfg, "objective")
    objective.load_state_dict(trained.objective)
    objective.to(device)
    extras = networks_of(objective, model_args, trained, device)
    micro_batch = local_batch_size(cfg.trainer.batch_size, cfg.trainer.grad_accum, world=1)
    x, y = Loader(dataset, batch_size=micro_batch, rank=0, world_size=1, seed=cfg.trainer.seed).next()
    y = y.to(device) if trained.model_args["num_classes"] else None
    # the first student step from max_steps on (an alternating objective's other steps update another network)
    for step in range(cfg.trainer.max_steps, cfg.trainer.max_steps + 16):
        torch.manual_seed(cfg.trainer.seed)
        with record_tangents() as tangents, torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss, _ = objective.loss(model, x.to(device), y, step=step, **extras)  # a phased loss reads its phase off the step
        if not isinstance(loss, Mapping) or "model" in loss:
            break
    else:
        raise ValueError(f"{type(objective).__name__} made no step of the trained model in 16 steps after step {step - 15}")
    loss = loss["model"] if isinstance(loss, Mapping) else loss
    loss.backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return grads, tangents[0] if tangents else None


def networks_of(objective, model_args: dict, trained: Trained, device: torch.device) -> dict[str, torch.nn.Module]:
    """The networks an objective's loss takes besides the model (flm.objectives.protocol.Network), built as the loop
    builds them: a frozen one (a teacher) anew, a trainable one (a fake score, a discriminator) with the run's final
    weights, and an EMA target network from the run's EMA of that decay."""
    extras = {}
    for name, network in objective.networks.items():
        net = network.build(model_args)
        if network.trainable:
            net.load_state_dict(trained.networks[name])
        else:
            net.requires_grad_(False).eval()
        extras[name] = net.to(device)
    decay = getattr(objective, "target_ema_decay", None)
    if decay is not None:
        target = build_model(**model_args)
        target.load_state_dict(trained.ema[ema_key(decay)])
        extras["ema"] = target.to(device).requires_grad_(False)
    return extras


# ----------------------------------------------------------------------------------------------
# Agreement with math
# ----------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compare(result: Result, ref: Result, tols: dict[str, float]) -> None:
    """Fill result.diffs and result.drift (NaN counts as drift)."""
    result.diffs["loss"], result.loss_noise = loss_gap(result.losses, ref.losses)
    names = [name for name in ref.grads if name in result.grads]
    flat = lambda g: torch.cat([g[name].flatten() for name in names])  # noqa: E731
    result.diffs["grad"] = rel_err(flat(result.grads), flat(ref.grads))
    if ref.tangent is not None and result.tangent is not None:
        result.diffs["tangent"] = rel_err(result.tangent, ref.tangent)
    # the loss gap counts only beyond 3 standard errors: past the first steps, bf16 runs of different
    # kernels follow different (equally good) trajectories, and per-batch losses scatter around them
    limits = {**tols, "loss": max(tols["loss"], 3 * result.loss_noise)}
    result.drift = [f"{k} {v:.1e} > {limits[k]:.0e}" for k, v in result.diffs.items() if not v <= limits[k]]


def loss_gap(losses: list[float], ref: list[float]) -> tuple[float, float]:
    """(|mean - mean_ref| / mean_ref, its standard error) over the last quarter of the steps.

    A step-by-step maximum would flag every bf16 backend: trajectories that agree to 1e-3 in the first
    steps (see the gradient check) drift apart chaotically, so the comparison is of where training got to.
    """
    n = min(len(losses), len(ref))
    q = max(1, n // 4)
    a, b = torch.tensor(losses[n - q : n], dtype=torch.float64), torch.tensor(ref[n - q : n], dtype=torch.float64)
    scale = b.mean().abs().clamp_min(1e-30)
    var = (a.var() + b.var()) / q if q > 1 else torch.zeros((), dtype=torch.float64)
    return ((a.mean() - b.mean()).abs() / scale).item(), (var.sqrt() / scale).item()


# ----------------------------------------------------------------------------------------------
# Table and plot
# ----------------------------------------------------------------------------------------------


def how_steps_ran(records: list[dict]) -> str | None:
    """How a run's timed steps ran, from its metrics.jsonl records (their cuda_graph): CUDA graph, eager or mixed;
    None where they do not say (a run logged before flm recorded it)."""
    graphed = {r["cuda_graph"] for r in records if "cuda_graph" in r}
    if not graphed:
        return None
    return "mixed" if len(graphed) > 1 else "CUDA graph" if graphed.pop() else "eager"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread(runs: list[float]) -> str:
    """' (min-max over N runs)' for a backend timed more than once, else nothing."""
    return f" ({min(runs):.1f}-{max(runs):.1f}, {len(runs)} runs)" if len(runs) > 1 else ""


def table(results: list[Result], title: str, lines: list[str], curve: str) -> str:
    out = [
        f"# {title}",
        "",
        *lines,
        "",
        f"| backend | ms / step (median) | steps | images / s | peak GiB | final {curve} | {curve} diff | grad rel err "
        "| tangent rel err | check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.skipped:
            check = "skipped: " + r.skipped.replace("|", "\\|")
        elif r.backend == "math":
            check = "reference"
        elif not r.diffs:
            check = "no math reference"
        else:
            check = "**DRIFT**: " + "; ".join(r.drift) if r.drift else "ok"
        peak = "n/a" if r.peak_gib is None and not r.skipped else _fmt(r.peak_gib, ".2f")
        out.append(
            " | ".join(
                [
                    f"| {r.backend}",
                    _fmt(r.step_ms, ".1f") + _spread(r.step_ms_runs),
                    r.steps or "-",
                    _fmt(r.images_per_s, ".1f"),
                    peak,
                    _fmt(r.losses[-1] if r.losses else None, ".4f"),
                    "-" if "loss" not in r.diffs else f"{r.diffs['loss']:.1e} ± {r.loss_noise:.0e}",
                    _fmt(r.diffs.get("grad"), ".1e"),
                    _fmt(r.diffs.get("tangent"), ".1e"),
                    f"{check} |",
                ]
            )
        )
    return "\n".join(out) + "\n"


def plot(results: list[Result], title: str, path: str, curve: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the ablation plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if not r.skipped]
    names = [r.backend for r in ran]
    fig, (ax_t, ax_m, ax_l) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_t.bar(names, [r.step_ms for r in ran], color="tab:blue")
    ax_t.set(title="step time (median)", ylabel="ms / step")
    if any(r.peak_gib is not None for r in ran):
        ax_m.bar(names, [r.peak_gib or 0 for r in ran], color="tab:orange")
    else:
        ax_m.text(0.5, 0.5, "n/a (no CUDA)", ha="center", va="center", transform=ax_m.transAxes)
        ax_m.set(xticks=[], yticks=[])
    ax_m.set(title="peak GPU memory", ylabel="GiB")
    for r in ran:
        ax_l.plot(range(1, len(r.losses) + 1), r.losses, label=r.backend, alpha=0.8)
    ax_l.set(title=f"training {curve}", xlabel="step", ylabel=curve)
    ax_l.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: torch.device, dtype: torch.dtype | None) -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    return (
        f"{name}; torch {torch.__version__}{cuda}, triton {triton_version}; "
        f"{'bf16 autocast' if dtype == torch.bfloat16 else 'fp32'}"
    )


# ----------------------------------------------------------------------------------------------
# The ablation
# ----------------------------------------------------------------------------------------------


def ablate(cfg: DictConfig, run_dir: str, command: str = "python ablate.py") -> list[Result]:
    """Train with every backend of cfg.ablate.backends, compare with math, write the table and plot."""
    a = cfg.ablate
    backends = sorted(dict.fromkeys(a.backends), key=lambda b: b != "math")  # math first, no repeats
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(
            f"ablate.backends has unknown attention backend(s) {', '.join(unknown)}; valid names: {', '.join(BACKENDS)}"
        )
    repeats = a.repeats
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"ablate.repeats must be a whole number of runs, 1 or more; got {repeats!r}")
    model = cfg.model.name
    side = image_side(model, a.tokens)
    device = dist.init(cfg.trainer.device)
    dtype = amp_dtype(cfg.trainer.precision, device)
    defaults = TOLERANCES["bf16" if dtype == torch.bfloat16 else "fp32"]
    tols = {k: d if a[f"{k}_tol"] is None else float(a[f"{k}_tol"]) for k, d in zip(("loss", "grad", "tangent"), defaults)}
    taken = [b for b in backends if os.path.exists(os.path.join(run_dir, b))]
    if taken:
        raise ValueError(f"run folder {run_dir!r} already has runs of {', '.join(taken)}; choose another run_dir")

    results, reference = [], None
    for backend in backends:
        dist.info0(f"ablation: {backend}")
        result, trained = train_with(cfg, backend, os.path.join(run_dir, backend), side, a.warmup, keep_weights=backend == "math")
        results.append(result)
        reference = reference or trained
    time_again(cfg, [r for r in results if not r.skipped], run_dir, side, a.warmup, repeats)
    if reference is not None:  # after all the runs, so that the probes add nothing to their peak memory
        dataset = data_at(cfg, side).build()
        for r in results:
            if not r.skipped:
                r.grads, r.tangent = probe(cfg, r.backend, reference, dataset, device, dtype)
        for r in results[1:]:
            if not r.skipped:
                compare(r, results[0], tols)

    curve = next((r.curve for r in results if not r.skipped), "loss")
    tokens = a.tokens or "native"
    title = (
        f"Attention backends: {model}, {cfg.objective.name}, {tokens} tokens, batch {cfg.trainer.batch_size}, "
        f"{cfg.trainer.max_steps} steps, seed {cfg.trainer.seed}"
    )
    timing = (
        f"; each backend trained {repeats} times, the rounds in alternating order, the median of its runs' medians "
        "with their range"
        if repeats > 1
        else ""
    )
    lines = [
        f"Device: {environment(device, dtype)}.",
        f"Data: {cfg.data.name}" + (f" resized to {side}x{side}" if side else "") + ".",
        f"Agreement with math: {curve} diff = |mean {curve} - mean {curve}_math| / mean {curve}_math over the last "
        f"quarter of the steps ± its standard error (flagged beyond {tols['loss']:.0e} and 3 standard errors: bf16 "
        f"runs with different kernels follow different trajectories); grad and tangent rel err: relative L2 error of the "
        f"gradient ({tols['grad']:.0e}) and of the objective's JVP tangent ({tols['tangent']:.0e}) in one loss on the first "
        f"batch at math's final weights. Step time: median after {a.warmup} warm-up steps{timing}.",
        f"Command: `{command}`",
    ]
    with open(os.path.join(run_dir, "ablation.md"), "w") as f:
        f.write(table(results, title, lines, curve))
    plot(results, title, os.path.join(run_dir, "ablation.png"), curve)
    numbers = [{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name not in ("grads", "tangent")} for r in results]
    with open(os.path.join(run_dir, "ablation.json"), "w") as f:
        json.dump({"title": title, "command": command, "tolerances": tols, "results": numbers}, f, indent=1)
    dist.info0(f"ablation: {os.path.join(run_dir, 'ablation.md')} and ablation.png")
    return results


if __name__ == "__main__":  # `python -m flm.ablate ...` is the checkout's ablate.py (its Hydra configs live beside it)
    import runpy
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ablate.py")
    if not os.path.isfile(script):
        sys.exit(f"error: {script} not found; `python -m flm.ablate` runs from a checkout of flm (configs/ beside it)")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
