"""Configs as data: objects are built from registered names and plain values, never from a `_target_`
found in a stored config (a checkpoint's, a shared YAML file's).

    objective = objective_from_config(bundle["config"]["objective"], where=path)   # sample.py
    trainer = build_group(cfg, "trainer")                                           # train.py, ablate.py

A checkpoint's config is rebuilt through flm.objectives.build_objective (its `_target_`, if any, must
be that one, and every other value a number, string, bool, null or a list of them). A composed
config's groups keep their own `_target_` (configs/ and the command line are the user's code: a
custom objective fits there), but the values below it must be data: a nested `_target_` anywhere
(a value that would call another function) is refused.
"""

import contextlib
import re
from collections.abc import Mapping

from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from flm.objectives import build_objective

PLAIN = (type(None), bool, int, float, str)
OBJECTIVE_TARGET = "flm.objectives.build_objective"
# Hydra's instantiate keys: each makes a value callable or call something.
_HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_call_", "_recursive_", "_convert_")


def plain(value, key: str):
    """`value` as plain containers when it holds only numbers, strings, bools, null and lists / dicts of
    them; else a ValueError naming `key` (a dict key that Hydra would call, such as `_target_`, included)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str) or k in _HYDRA_KEYS:
                raise ValueError(
                    f"{key}.{k} is not allowed: a config from a file holds names and numbers, not "
                    f"callable references; remove it (a checkpoint with it was not written by flm)"
                )
        return {k: plain(v, f"{key}.{k}") for k, v in value.items()}
    raise ValueError(f"{key} is a {type(value).__name__}, not a number, string, bool, null or list of them")


def objective_from_config(section, where: str):
    """The objective a stored config names (`name` and plain keyword values), built from the registry."""
    if not isinstance(section, Mapping) or "name" not in section:
        raise ValueError(
            f"{where}: the stored config has no objective name, so no sampler to draw samples with; "
            f"pass a checkpoint written by train.py"
        )
    section = dict(section)
    target = section.pop("_target_", OBJECTIVE_TARGET)
    if target != OBJECTIVE_TARGET:
        raise ValueError(
            f"{where}: objective._target_={target!r} is not allowed (only {OBJECTIVE_TARGET}); "
            f"pass a checkpoint written by train.py"
        )
    kwargs = plain(section, f"{where}: objective")
    with options_of("objective"):
        return build_objective(**kwargs)


def check_targets(section, key: str) -> None:
    """Refuse any `_target_` (or other Hydra call key) below a group's own."""
    for k, v in section.items() if isinstance(section, Mapping) else ():
        if k not in _HYDRA_KEYS:
            plain(v, f"{key}.{k}")


def build_group(cfg: DictConfig, key: str):
    """instantiate(cfg[key]) after check_targets; an option the target does not take names its key."""
    section = cfg[key]
    check_targets(section, key)
    with options_of(key):
        return instantiate(section)


_UNEXPECTED = re.compile(r"unexpected keyword argument '(\w+)'")


@contextlib.contextmanager
def options_of(key: str):
    """Building the `key` group: an option its target does not take ends in one line naming `key.option`."""
    try:
        yield
    except Exception as e:
        cause = e.__cause__ if type(e).__name__ == "InstantiationException" and e.__cause__ is not None else e
        match = _UNEXPECTED.search(str(cause)) if isinstance(cause, TypeError) else None
        if match is None:
            raise
        raise ValueError(
            f"{key}.{match.group(1)} is not an option of {key}; check its spelling (the options are in configs/{key}/)"
        ) from None
