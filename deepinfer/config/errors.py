"""ConfigError and the translation of Hydra/OmegaConf composition errors into one line.

A user error in the configuration must read as one line that names the key, the value and what is allowed, never
as a traceback: the CLI prints the message and exits 2, the Python API raises ConfigError with it. Errors are told
apart by their exception type and read through their attributes (a missing option's `missing_cfg_file` and
`options`, a bad key's `full_key`, a value's `value`, an override's parse), never by matching their message text.
"""

from __future__ import annotations

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    InterpolationValidationError,
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
    """The one-line ConfigError for an exception raised while Hydra composed the config with `overrides`
    (command-line arguments that are not overrides, such as --multirun, are ignored)."""
    from deepinfer.config.keys import allowed_keys, describe_type

    if isinstance(exc, ConfigError):
        return exc
    overrides = [o for o in overrides if "=" in o and not o.startswith("-")]
    if isinstance(exc, MissingConfigException) and "/" in (exc.missing_cfg_file or ""):
        group, _, option = exc.missing_cfg_file.rpartition("/")
        plus = "+" if group == "recipe" else ""
        options = ", ".join(exc.options) if exc.options else "none found"  # Hydra's list: an own recipe folder too
        return ConfigError(f"{plus}{group}={option} is not an option of config group {group!r}; allowed: {options}")
    if isinstance(exc, OverrideParseException):
        return ConfigError(f"{exc.override}: {_first_line(exc.message)}")
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
    if isinstance(cause, InterpolationValidationError) and key:  # e.g. an environment variable of the wrong type
        return ConfigError(f"{key}={cause.child_node} resolved to {fmt(cause.value)}, which has the wrong type; "
                           f"allowed: {describe_type(key)}")
    if isinstance(cause, InterpolationResolutionError) and key:
        return ConfigError(f"{key}={cause.child_node} cannot be resolved: {_first_line(cause.msg)}")
    if isinstance(cause, ValidationError) and key and describe_type(key) == "(no such key)":
        # OmegaConf reports keys below a typed mapping relative to it; the override itself is the clearer name.
        given = _override_ending(key, overrides)
        return ConfigError(f"{given or key}: {_first_line(cause.msg)}")
    if isinstance(cause, ValidationError) and key:
        value = _override_value(key, overrides)
        if value is None:
            value = fmt(getattr(cause, "value", "?"))
        return ConfigError(f"{key}={value} has the wrong type; allowed: {describe_type(key)}")
    if isinstance(exc, ConfigCompositionException) and exc.__cause__ is None:
        sweep = _sweep_override(overrides)
        if sweep is not None:  # Hydra's run mode refuses a sweep (a,b) outside --multirun
            k, v = sweep.get_key_element(), sweep.input_line.partition("=")[2]
            return ConfigError(f"{k}={v} is ambiguous; allowed: --multirun to sweep over it, {k}=[{v}] for a list, "
                               f"{k}='{v}' for a string")
    return ConfigError(_first_line(str(exc)) or type(exc).__name__)


def _first_line(text) -> str:
    return next((line for line in str(text or "").splitlines() if line.strip()), "")


def _override_value(key: str, overrides) -> str | None:
    for ov in overrides:
        k, sep, v = ov.lstrip("+~").partition("=")
        if sep and k == key:
            return v
    return None


def _override_ending(key: str, overrides) -> str | None:
    """The override whose key is `key` or ends with it (OmegaConf names keys below a mapping relative to it)."""
    for ov in overrides:
        k = ov.lstrip("+~").partition("=")[0]
        if k == key or k.endswith("." + key):
            return ov
    return None


def _sweep_override(overrides):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 (a parse error is reported by Hydra itself)
        return None
    return next((ov for ov in parsed if ov.is_sweep_override()), None)
