"""Config dataclasses checked against their annotations, so a value of the wrong type (batch_size=abc,
max_steps=2.5, ema_decays=0.5) ends in one line naming its key instead of a traceback later on."""

import dataclasses
import types
import typing
from collections.abc import Sequence


def check_fields(obj, section: str) -> None:
    """Check every field of the dataclass `obj` against its annotation (int, float, bool, str, X | None,
    list[X], tuple[X, ...]); keys are named `section.field` (`field` when section is ""); ints become
    floats where a float is due, lists become the annotated kind."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{section}.{f.name}" if section else f.name
        setattr(obj, f.name, typed(getattr(obj, f.name), hints[f.name], key))


def typed(value, tp, key: str):
    """`value` as the type `tp`, or a ValueError naming `key`, the value and an example of the type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return typed(value, arg, key)
            except ValueError as e:
                errors.append(e)
        raise errors[0]
    if origin in (list, tuple):
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ValueError(f"{key} must be a list, got {value!r}; e.g. {key}=[{value}]")
        if origin is tuple and args[-1] is not Ellipsis and len(value) != len(args):
            raise ValueError(f"{key} must be a list of {len(args)} numbers, got {list(value)}")
        kinds = args if origin is tuple and args[-1] is not Ellipsis else [args[0]] * len(value)
        items = [typed(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, kinds))]
        return origin(items)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (int, bool, str) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    if tp in (int, float, bool, str):
        example = {int: "an integer, e.g. 8", float: "a number, e.g. 0.5", bool: "true or false", str: "a string"}[tp]
        raise ValueError(f"{key} must be {example}; got {value!r}")
    return value
