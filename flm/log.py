"""Run logging: a progress line on the console, metrics.jsonl always, wandb when asked.

Only rank 0 writes; other ranks get a logger whose methods do nothing.
"""

import json
import math
import os
import statistics
import time
from dataclasses import dataclass

from flm import dist
from flm.files import write_atomically
from flm.typed import check_fields


@dataclass
class LoggerConfig:
    """wandb: also log to Weights & Biases (`pip install wandb`); mode "offline" needs no account."""

    wandb: bool = False
    project: str = "flm"
    name: str | None = None
    mode: str = "offline"  # online | offline | disabled

    def __post_init__(self):
        check_fields(self, "logger")
        if self.mode not in ("online", "offline", "disabled"):
            raise ValueError(f"logger.mode must be online, offline or disabled, got {self.mode!r}")


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_line(step: int, max_steps: int, metrics: dict, elapsed: float, eta: float) -> str:
    """`step 120/1500 [##........] 8% | loss 0.1234 | 512 img/s | 45.1 ms/step | 1.20 GiB | 0m05s<3m12s`."""
    width = 20
    filled = int(width * step / max(max_steps, 1))
    parts = [f"step {step}/{max_steps} [{'#' * filled}{'.' * (width - filled)}] {100 * step / max(max_steps, 1):3.0f}%"]
    if "loss" in metrics:
        parts.append(f"loss {metrics['loss']:.4f}")
    for name, value in metrics.items():  # a distillation's other networks: "fake_score.loss" -> "fake_score 0.1234"
        if name.endswith(".loss"):
            parts.append(f"{name[: -len('.loss')]} {value:.4f}")
    if "mse" in metrics:
        parts.append(f"mse {metrics['mse']:.4f}")
    if "images_per_s" in metrics:
        parts.append(f"{metrics['images_per_s']:.0f} img/s")
    if "step_ms" in metrics:
        parts.append(f"{metrics['step_ms']:.1f} ms/step" + (" (CUDA graph)" if metrics.get("cuda_graph") else ""))
    if "gpu_mem_gib" in metrics:
        parts.append(f"{metrics['gpu_mem_gib']:.2f} GiB")
    if "warmup_s" in metrics:  # compilation, capture: left out of ms/step
        parts.append(f"warm-up {metrics['warmup_s']:.1f} s")
    parts.append(f"{_duration(elapsed)}<{_duration(eta)}")
    return " | ".join(parts)


def drop_after(path: str, step: int) -> None:
    """Remove the lines of steps after `step` from a metrics.jsonl: a resumed run logs them again."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = [line for line in lines if _step_of(line) <= step]
    if len(keep) < len(lines):

        def write(tmp):
            with open(tmp, "w") as f:
                f.writelines(keep)

        write_atomically(path, write)


def read_metrics(run_dir: str) -> list[dict]:
    """The records of run_dir/metrics.jsonl, one per logged step (a last line cut off by a kill is left out)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir!r}: expected a train.py run folder (its run_dir)")
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                if line.endswith("\n"):  # a damaged line inside the file, not a last line cut off
                    raise ValueError(f"{path}: a line is not JSON: {line[:80]!r}") from None
    return records


def training_seconds(records: list[dict]) -> list[tuple[int, float]]:
    """(step, seconds of training up to it) at each logged window's end, from a run's metrics records: each window's
    steps x its ms/step, except the first (compilation, CUDA-graph capture) and any window that holds an in-loop
    evaluation (in runs logged before the loop paused its meter around evaluations, grids and checkpoints, that
    window's step_ms counts the sampling too), which are charged at the median of the others. A sum, not steps x
    one figure: a run whose steps change cost (MeanFlow's consistency curriculum) is charged for each kind. Since the
    forty-sixth day the loop leaves each kind of step's first run in a process out of its window (logged as
    warmup_s), so a resumed run's or a new phase's compilation and capture are no longer charged either."""
    windows = [r for r in records if "step_ms" in r]
    evals = sorted(r["step"] for r in records if any(k.startswith(("fid_steps", "label_acc_steps")) for k in r))
    if len(windows) < 2:
        raise ValueError(f"{len(windows)} logged windows: a run's time needs two (the first holds its compilation)")
    starts = [0] + [w["step"] for w in windows[:-1]]
    # an evaluation at step k runs after step k, inside the window (a, b] with a <= k < b
    held = [i == 0 or any(a <= k < w["step"] for k in evals) for i, (a, w) in enumerate(zip(starts, windows))]
    steady = [w["step_ms"] for w, h in zip(windows, held) if not h] or [w["step_ms"] for w in windows[1:]]
    median = statistics.median(steady)
    total, out = 0.0, []
    for a, w, h in zip(starts, windows, held):
        total += (w["step"] - a) * (median if h else w["step_ms"]) / 1000
        out.append((w["step"], total))
    return out


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a line cut off by a kill: dropped with the steps after the checkpoint


class RunLogger:
    """Console progress, run_dir/metrics.jsonl (one JSON object per logged step) and optional wandb."""

    def __init__(self, run_dir: str, config: LoggerConfig, *, run_config: dict | None = None, resumed_at: int | None = None):
        self.active = dist.is_main()
        self.wandb = None
        if not self.active:
            return
        if config.wandb:
            try:
                import wandb
            except ImportError:
                raise ImportError("logger=wandb needs the wandb package: pip install wandb (or use logger=none)") from None
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        if resumed_at is not None:
            drop_after(path, resumed_at)
        self.file = open(path, "a")  # noqa: SIM115 (open for the whole run; close() closes it)
        if config.wandb:
            self.wandb = wandb.init(
                project=config.project, name=config.name, mode=config.mode, dir=run_dir, config=run_config, resume="allow"
            )

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in metrics.items()}
        # json has no NaN/inf; write them as strings so the file stays valid JSON
        clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_image(self, step: int, key: str, path: str) -> None:
        if self.wandb is not None:
            import wandb

            self.wandb.log({key: wandb.Image(path)}, step=step)

    def close(self) -> None:
        if not self.active:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
