"""Questions about the schema by dotted key: which keys exist below a node, what type and range a leaf takes.
Used to word error messages; the schema itself is deepinfer/config/schema.py."""

from __future__ import annotations

import dataclasses
import typing

from deepinfer.config.schema import Settings

_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _node(path: str):
    """(type, field metadata) at a dotted path; keys below a Dict[str, X] may be anything."""
    tp, meta = Settings, {}
    for part in [p for p in path.split(".") if p]:
        tp = strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            fields = {f.name: f for f in dataclasses.fields(tp)}
            if part not in fields:
                return None, {}
            tp, meta = hints[part], dict(fields[part].metadata)
        elif typing.get_origin(tp) is dict:
            tp, meta = typing.get_args(tp)[1], {}
        else:
            return typing.Any, {}
    return tp, meta


def strip_optional(tp):
    """Optional[X] -> X (other types unchanged)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def allowed_keys(path: str) -> list[str]:
    tp, _ = _node(path)
    tp = strip_optional(tp)
    if dataclasses.is_dataclass(tp):
        return [f.name for f in dataclasses.fields(tp)]
    return ["(any)"]


def describe_type(path: str) -> str:
    tp, meta = _node(path)
    if tp is None:
        return "(no such key)"
    optional = strip_optional(tp) is not tp
    base = strip_optional(tp)
    allowed = meta.get("allowed")
    if isinstance(allowed, tuple):
        words = "one of " + ", ".join(allowed)
    elif typing.get_origin(base) is list:
        words = "a list of " + _TYPE_WORDS.get(typing.get_args(base)[0], "values").split(" ", 1)[-1] + "s"
    elif typing.get_origin(base) is dict:
        words = "a mapping"
    else:
        words = _TYPE_WORDS.get(base, str(base))
        if allowed is not None:
            words = str(allowed) if allowed.text else f"{words} in {allowed}"
    return words + (" or null" if optional else "")
