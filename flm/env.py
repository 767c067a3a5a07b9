"""On/off switches flm reads from the environment (FLM_ATTENTION_AUTOTUNE, FLM_ATTENTION_NATIVE_NODE)."""

import functools
import os


ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no")


def switch(name: str, default: bool, on: str, off: str) -> bool:
    """The environment variable `name` as a switch: 1 (or true, on, yes), 0 (or false, off, no), unset or empty the
    default. Read on every call, so scripts and tests may set it late; `on` and `off` say what each value does, for the
    error that any other value raises."""
    return _parse(name, os.environ.get(name, ""), default, on, off)


@functools.cache
def _parse(name: str, value: str, default: bool, on: str, off: str) -> bool:
    value = value.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    if value == "":
        return default
    on, off = (f"{on}, the default", off) if default else (on, f"{off}, the default")
    raise ValueError(f"{name}={value!r}: set 1 ({on}) or 0 ({off})")
