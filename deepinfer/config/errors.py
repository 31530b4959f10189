"""ConfigError and the translation of Hydra/OmegaConf composition errors into one line.

A user error in the configuration must read as one line that names the key, the value and what is allowed, never
as a traceback: the CLI prints the message and exits 2, the Python API raises ConfigError with it.
"""

from __future__ import annotations

import re

from hydra.errors import MissingConfigException
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    ValidationError,
)


class ConfigError(ValueError):
    """A configuration the program cannot run; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def fmt(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def explain(exc: BaseException, overrides: list[str] | tuple[str, ...] = ()) -> ConfigError:
    """The one-line ConfigError for an exception raised while Hydra composed the config with `overrides`."""
    from deepinfer.config.compose import group_options
    from deepinfer.config.keys import allowed_keys, describe_type

    if isinstance(exc, ConfigError):
        return exc
    text = str(exc)
    missing = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if isinstance(exc, MissingConfigException) and missing:
        group, option = missing.group(1), missing.group(2)
        plus = "+" if group == "recipe" else ""
        options = getattr(exc, "options", None) or group_options(group)  # Hydra's list: an own recipe folder too
        return ConfigError(
            f"{plus}{group}={option} is not an option of config group {group!r}; allowed: " + ", ".join(options)
        )
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key:
        parent, _, leaf = key.rpartition(".")
        where = f"in {parent!r}" if parent else "at the top level"
        value = _override_value(key, overrides)
        shown = f"{key}={value}" if value is not None else key
        return ConfigError(
            f"{shown}: unknown config key {leaf!r}; allowed {where}: " + ", ".join(allowed_keys(parent))
        )
    if isinstance(cause, MissingMandatoryValue) and key:
        return ConfigError(f"{key} is required and has no value; set it, e.g. {key}=...")
    if isinstance(cause, InterpolationResolutionError) and key:
        interp = re.search(r"interpolation '(\$\{[^']*\})'", str(cause))
        value = _quoted_value(str(cause))
        source = f"{key}={interp.group(1)} resolved to {value}" if interp else f"{key}={value}"
        return ConfigError(f"{source}, which has the wrong type; allowed: {describe_type(key)}")
    merging = re.match(r"Error merging override (.+)", text)
    if isinstance(cause, ValidationError) and merging and describe_type(key or "") == "(no such key)":
        # OmegaConf reports keys below a typed mapping relative to it; the override itself is the clearer name.
        return ConfigError(f"{merging.group(1)}: {str(cause).splitlines()[0]}")
    if isinstance(cause, ValidationError) and key:
        value = _override_value(key, overrides)
        if value is None:
            value = _quoted_value(str(cause))
        return ConfigError(f"{key}={value} has the wrong type; allowed: {describe_type(key)}")
    if text.startswith("Ambiguous value for argument"):
        arg = re.search(r"argument '([^=']+)=([^']*)'", text)
        k, v = (arg.group(1), arg.group(2)) if arg else ("key", "a,b")
        return ConfigError(
            f"{k}={v} is ambiguous; allowed: --multirun to sweep over it, {k}=[{v}] for a list, {k}='{v}' for a string"
        )
    first = next((line for line in text.splitlines() if line.strip()), type(exc).__name__)
    return ConfigError(first)


def _override_value(key: str, overrides) -> str | None:
    for ov in overrides:
        k, sep, v = ov.lstrip("+~").partition("=")
        if sep and k == key:
            return v
    return None


def _quoted_value(message: str) -> str:
    m = re.search(r"Value '([^']*)'", message)
    return repr(m.group(1)) if m else "?"
