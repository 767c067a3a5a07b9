"""One-file checkpoint bundles in RUN_DIR/checkpoints/, written atomically, the last K kept.

A bundle is a dict: model, ema ({decay: state}), optimizer, scheduler, objective, step, rng, data
(loader position), nonfinite (skipped-step counters), model_args (what build_model was called with)
and config (the resolved Hydra config of the run, as plain containers).
"""

import glob
import os
import re

import torch

FORMAT = 1
_NAME = re.compile(r"ckpt-(\d+)\.pt$")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoint_path(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"ckpt-{step:08d}.pt")


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first (temporary files of an interrupted write are ignored)."""
    paths = [p for p in glob.glob(os.path.join(checkpoint_dir(run_dir), "ckpt-*.pt")) if _NAME.search(p)]
    return sorted(paths, key=lambda p: int(_NAME.search(p).group(1)))


def find_checkpoint(path: str) -> str:
    """A checkpoint file: `path` itself, or the latest one in a run folder (or its checkpoints/ folder)."""
    if os.path.isfile(path):
        return path
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist; pass a run folder or a checkpoint file (.pt)")
    run_dir = os.path.dirname(path.rstrip("/")) if os.path.basename(path.rstrip("/")) == "checkpoints" else path
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no checkpoint in {path!r} (looked for {os.path.join(checkpoint_dir(run_dir), 'ckpt-*.pt')}); "
            f"pass the folder of a run that has saved one, or a checkpoint file"
        )
    return found[-1]


def save(bundle: dict, path: str, *, keep_last: int = 0) -> None:
    """Write `bundle` to `path` through a temporary file and a rename, then delete all but the
    `keep_last` newest checkpoints of the folder (keep_last <= 0 keeps all)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({"format": FORMAT, **bundle}, tmp)
    os.replace(tmp, path)
    if keep_last > 0:
        for old in list_checkpoints(os.path.dirname(os.path.dirname(path)))[:-keep_last]:
            os.remove(old)


def load(path: str) -> dict:
    """The bundle in `path` on the CPU; a clear error when it is truncated or not an flm checkpoint."""
    try:
        bundle = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(
            f"checkpoint {path!r} is truncated or unreadable ({type(e).__name__}: {str(e).splitlines()[0]}); "
            f"delete it to use the previous one, or pass another checkpoint"
        ) from None
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT or "model_args" not in bundle:
        raise ValueError(f"{path!r} is not an flm checkpoint (format {FORMAT}); pass a file written by train.py")
    return bundle


def check_model_args(path: str, saved: dict, current: dict) -> None:
    """Raise a clear error when the checkpoint was written for another model than the one built now."""
    diff = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
            if k != "attention" and saved.get(k) != current.get(k)}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"checkpoint {path!r} is for another model ({detail}); pass the model/data options the run "
            f"was trained with (e.g. model={saved.get('name')}) or start a new run folder"
        )
