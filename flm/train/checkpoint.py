"""One-file checkpoint bundles in RUN_DIR/checkpoints/, written atomically, the last K kept.

A bundle is a dict of the parts flm.train.state.TrainState.parts() names (model, ema, optimizer,
scheduler, objective, data, rng, step, nonfinite, log_window, model_args: what build_model was called
with, config: the resolved Hydra config of the run as plain containers), plus its format number.

Model, EMA and optimizer state hold whole tensors on the CPU, gathered from FSDP2's shards where the
run was sharded (model_state, optimizer_state), so one bundle resumes under one process, DDP or FSDP2,
with any number of ranks. The optimizer keeps torch.optim's layout (parameters numbered in the
optimizer's order).
"""

import glob
import os
import re
import zipfile

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from flm.files import write_atomically
from flm.models import RUNTIME_OPTIONS, complete_args

FORMAT = 1
_NAME = re.compile(r"ckpt-(\d+)\.pt$")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoint_path(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"ckpt-{step:08d}.pt")


def step_of(path: str) -> int:
    """The step in a checkpoint's file name (ckpt-<step>.pt, as checkpoint_path writes it)."""
    found = _NAME.search(path)
    if found is None:
        raise ValueError(f"{path!r} is not named ckpt-<step>.pt; pass a run folder or one of its checkpoints/ files")
    return int(found.group(1))


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first (temporary files of an interrupted write are ignored)."""
    paths = [p for p in glob.glob(os.path.join(checkpoint_dir(run_dir), "ckpt-*.pt")) if _NAME.search(p)]
    return sorted(paths, key=step_of)


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


def resolve_resume(resume: str | None, run_dir: str) -> str | None:
    """The checkpoint to continue from, or None for a new run; clear errors for every bad case."""
    if resume in (None, "", "null", "none", False):
        existing = list_checkpoints(run_dir)
        if existing:
            raise ValueError(
                f"run folder {run_dir!r} already has checkpoints (latest {os.path.basename(existing[-1])}); "
                f"pass trainer.resume=auto to continue it, or choose another run_dir"
            )
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        if not found:
            raise FileNotFoundError(
                f"trainer.resume=auto but run folder {run_dir!r} has no checkpoint; pass run_dir=<folder of the "
                f"run to continue> (or trainer.resume=<checkpoint file>), or drop trainer.resume to start anew"
            )
        return found[-1]
    return find_checkpoint(str(resume))


def remove_temporary(run_dir: str) -> None:
    """Delete what interrupted writes left in the run's checkpoint folder (call under the run's lock)."""
    for tmp in glob.glob(os.path.join(checkpoint_dir(run_dir), "*.tmp")):
        os.remove(tmp)


def save(bundle: dict, path: str, *, keep_last: int = 0) -> None:
    """Write `bundle` to `path` through a temporary file and a rename, then delete all but the
    `keep_last` newest checkpoints of the folder (keep_last <= 0 keeps all). A full disk ends in one
    line and leaves no temporary file (flm.files.write_atomically)."""
    bundle = {"format": FORMAT, **bundle}
    write_atomically(path, lambda tmp: torch.save(bundle, tmp), needed_bytes=tensor_bytes(bundle))
    if keep_last > 0:
        for old in list_checkpoints(os.path.dirname(os.path.dirname(path)))[:-keep_last]:
            os.remove(old)


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in a nested bundle: about what its file takes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


# what to do about a checkpoint that cannot be loaded, for a resume (it takes the latest checkpoint) and for sampling
INSTEAD = "pass another checkpoint, or delete it so that a resume or a run folder takes the one before it"


def unreadable_reason(path: str, e: Exception) -> str:
    """Why torch.load refused `path`, in a few words. Never torch's own advice for weights_only refusals: it suggests
    weights_only=False, which would let the file run code."""
    if not zipfile.is_zipfile(path):
        return "not a zip archive, which torch.save writes: cut short, or another kind of file"
    if "Weights only load failed" in str(e):
        return "it holds Python objects besides tensors, which flm does not unpickle: loading them could run code"
    return f"{type(e).__name__}: {(str(e).splitlines() or ['empty file'])[0]}"


def load(path: str) -> dict:
    """The bundle in `path` on the CPU; a clear error when it is truncated or not an flm checkpoint."""
    try:
        bundle = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path!r} is truncated or unreadable ({unreadable_reason(path, e)}); {INSTEAD}") from None
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT or "model_args" not in bundle:
        raise ValueError(f"{path!r} is not an flm checkpoint (format {FORMAT}); pass a file written by train.py")
    damaged = zipfile.ZipFile(path).testzip()  # torch.save's zip records carry CRC-32s; torch.load does not check them
    if damaged is not None:
        raise ValueError(f"checkpoint {path!r} is damaged (checksum mismatch in {damaged}); {INSTEAD}")
    return bundle


def saved_prediction(path: str) -> str:
    """The model.prediction of a checkpoint (a file, or a run folder's latest; older checkpoints: velocity), for a
    model.prediction=auto that continues it (a resume) or starts from it (a distilled student's teacher). Reads
    model_args through a memory map, not the weights."""
    from flm.train.config import plain  # flm.train.config imports the objectives, which import this module

    source = find_checkpoint(path)
    try:
        args = torch.load(source, map_location="cpu", weights_only=True, mmap=True)["model_args"]
    except Exception:  # not a zip checkpoint, or no model_args: load's clear error
        args = load(source)["model_args"]
    return complete_args(plain(args, f"{source}: model_args"))["prediction"]


def check_model_args(path: str, saved: dict, current: dict) -> None:
    """Raise a clear error when the checkpoint was written for another model than the one built now."""
    saved, current = complete_args(saved), complete_args(current)
    diff = {
        k: (saved.get(k), current.get(k))
        for k in sorted(set(saved) | set(current))
        if k not in RUNTIME_OPTIONS and saved.get(k) != current.get(k)
    }
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"checkpoint {path!r} is for another model ({detail}); pass the model/data options the run "
            f"was trained with (e.g. model={saved.get('name')}) or start a new run folder"
        )


def check_objective(path: str, saved: dict, config: dict) -> None:
    """Refuse a resume with another objective than the run's (flow matching resumed as sCM, say)."""
    was, now = (saved or {}).get("objective", {}).get("name"), (config or {}).get("objective", {}).get("name")
    if was is not None and now is not None and was != now:
        raise ValueError(_another_objective(path, f"objective {was!r} vs {now!r}", was))


def load_objective(path: str, state: dict, objective) -> None:
    """The checkpoint's objective state into `objective`; state keys of another objective in one line."""
    try:
        objective.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(_another_objective(path, str(e).splitlines()[0], None)) from None


def _another_objective(path: str, detail: str, was: str | None) -> str:
    return (
        f"checkpoint {path!r} was trained with another objective ({detail}); resume with "
        f"objective={was or 'the one it was trained with'}, or start a new run folder"
    )


# ----------------------------------------------------------------------------------------------
# Whole-tensor state of sharded or unsharded modules. Every rank must call these (under FSDP2 they
# all-gather the shards); the getters return the state on rank 0 and {} on the others.
# ----------------------------------------------------------------------------------------------

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True)  # every rank has read the whole bundle: no broadcast


def model_state(model) -> dict:
    """model.state_dict() with whole tensors on the CPU."""
    return get_model_state_dict(model, options=_GATHER)


def load_model_state(model, state: dict) -> None:
    """Load model_state()'s whole tensors into `model`, each rank keeping its shards."""
    set_model_state_dict(model, state, options=_SCATTER)


def optimizer_state(modules, opt) -> dict:
    """opt.state_dict() with whole tensors on the CPU; `modules` holds every parameter of `opt`."""
    named = get_optimizer_state_dict(modules, opt, options=_GATHER)  # keyed by parameter name
    if not named:
        return {}
    names = [name for group in named["param_groups"] for name in group["params"]]  # the optimizer's order
    return _rekeyed(named, {name: i for i, name in enumerate(names)})


def load_optimizer_state(modules, opt, state: dict) -> None:
    """Load optimizer_state()'s layout into `opt`, each rank keeping its shards."""
    name_of = {p: name for name, p in modules.named_parameters()}
    names = [name_of[p] for group in opt.param_groups for p in group["params"]]
    set_optimizer_state_dict(modules, opt, _rekeyed(state, dict(enumerate(names))), options=_SCATTER)


def _rekeyed(state: dict, key: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped through `key` (names <-> numbers)."""
    return {
        "state": {key[k]: v for k, v in state["state"].items()},
        "param_groups": [{**group, "params": [key[k] for k in group["params"]]} for group in state["param_groups"]],
    }
