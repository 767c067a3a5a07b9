"""Weights people can share: one EMA of a run as model.safetensors, with config.json (the model's and the
objective's arguments, the grid sampler steps, the dataset and, for a latent run, the VAE). Nothing in the
folder needs pickle; sample.py and evaluate.py take the folder where they take a checkpoint.

    folder = export(checkpoint.load(path), "exports/run", ema="sigma_rel0.05", source=path)
    bundle = load_export("exports/run")        # the parts of a checkpoint that sampling reads
"""

import json
import os

from flm.files import write_atomically, write_json
from flm.train.config import objective_from_config, plain
from flm.train.generator import ema_name, generator_state

CONFIG, WEIGHTS, FORMAT = "config.json", "model.safetensors", "flm-export"


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "exported weights are safetensors files: pip install safetensors (or pip install 'flm[latent]')"
        ) from None
    return safetensors.torch


def export(bundle: dict, out: str, *, ema=None, source: str = "the checkpoint") -> str:
    """Write `out`/model.safetensors (the EMA `ema`, default the run's first) and `out`/config.json."""
    if not bundle.get("ema"):
        raise ValueError(
            f"{source} keeps no EMA (trainer.ema_decays=[] and trainer.ema_sigma_rels=[]); export writes an "
            f"EMA of the weights: train with trainer.ema_decays=[0.9999] (or ema_sigma_rels=[0.05])"
        )
    key = ema_name(ema) or next(iter(bundle["ema"]))
    state = generator_state(bundle, "ema", ema=key)
    run_cfg = bundle.get("config") or {}
    objective_from_config(run_cfg.get("objective"), where=source)  # refuses what it would refuse at sampling
    without_target = lambda section: {k: v for k, v in (section or {}).items() if k != "_target_"}  # noqa: E731
    latents = run_cfg.get("latents")
    config = {
        "format": FORMAT,
        "version": 1,
        "ema": key,
        "step": int(bundle.get("step", 0)),
        "model_args": plain(bundle["model_args"], f"{source}: model_args"),
        "objective": plain(without_target(run_cfg.get("objective")), f"{source}: objective"),
        "sample_steps": (run_cfg.get("trainer") or {}).get("sample_steps"),
        "data": plain(without_target(run_cfg.get("data")), f"{source}: data"),
        "vae": None if not latents else latents["vae"],
        "latents": plain(latents, f"{source}: latents"),
    }
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}
    write_atomically(os.path.join(out, WEIGHTS), lambda tmp: _safetensors().save_file(tensors, tmp))
    write_json(os.path.join(out, CONFIG), config)
    return out


def is_export(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def load_export(folder: str) -> dict:
    """An exported folder as the bundle parts that sampling reads (model_args, config, ema: {its key: weights})."""
    path = os.path.join(folder, CONFIG)
    with open(path) as f:
        config = json.load(f)
    if config.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not an flm export (format {config.get('format')!r}); write one with export.py")
    weights = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"exported folder {folder!r} lacks {WEIGHTS}; export the run again with export.py")
    run_cfg = {
        "objective": config["objective"],
        "trainer": {"sample_steps": config.get("sample_steps")},
        "data": config.get("data"),
        "latents": config.get("latents"),
    }
    return {
        "model_args": config["model_args"],
        "config": run_cfg,
        "ema": {config["ema"]: _safetensors().load_file(weights)},
        "step": config.get("step", 0),
    }
