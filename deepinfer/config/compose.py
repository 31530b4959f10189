"""Hydra composition shared by the CLI and the Python API, so the two can never drift.

Two things are registered in Hydra's ConfigStore when this module is imported:
- `deepinfer_schema`: the structured schema (deepinfer/config/schema.py) that config.yaml lists first in its
  defaults, so Hydra itself rejects unknown keys and wrongly typed values;
- group `recipe`: every `recipes/*.yaml` (package `deepinfer.recipes`). Recipes live in the top-level recipes/
  folder for ops teams, yet Hydra looks a `+recipe=NAME` option up in a folder named after the group; storing the
  files under group `recipe` keeps the folder name and makes them found after any install (they are package data).
"""

from __future__ import annotations

import dataclasses
import typing
from contextlib import contextmanager
from importlib import resources

from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from deepinfer.config.schema import Settings

CONFIG_MODULE = "deepinfer.conf"
CONFIG_NAME = "config"
RECIPE_PACKAGE = "deepinfer.recipes"


_TWINS: dict[type, type] = {}


def _mutable_twin(cls):
    """A non-frozen copy of a frozen settings dataclass (recursively). OmegaConf marks nodes built from frozen
    dataclasses read-only, and Hydra must merge the YAML files and overrides into the schema."""
    if cls in _TWINS:
        return _TWINS[cls]
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        kw = {"metadata": f.metadata}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
            kw["default_factory"] = _mutable_twin(factory) if dataclasses.is_dataclass(factory) else factory
        specs.append((f.name, _twin_type(hints[f.name]), dataclasses.field(**kw)))
    _TWINS[cls] = dataclasses.make_dataclass(cls.__name__, specs)
    return _TWINS[cls]


def _twin_type(tp):
    if dataclasses.is_dataclass(tp):
        return _mutable_twin(tp)
    args = typing.get_args(tp)
    if args and hasattr(tp, "copy_with"):
        return tp.copy_with(tuple(_twin_type(a) for a in args))
    return tp


def recipe_names() -> list[str]:
    root = resources.files(RECIPE_PACKAGE)
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def group_options(group: str) -> list[str]:
    if group == "recipe":
        return recipe_names()
    root = resources.files(CONFIG_MODULE) / group
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="deepinfer_schema", node=_mutable_twin(Settings))
    root = resources.files(RECIPE_PACKAGE)
    for name in recipe_names():
        node = OmegaConf.create((root / f"{name}.yaml").read_text())
        store.store(group="recipe", name=name, node=node, package="_global_")


register()


@contextmanager
def _fresh_global_hydra():
    """compose() needs GlobalHydra; when we run inside a Hydra app (the CLI) its instance is set aside and put back."""
    gh = GlobalHydra.instance()
    saved = gh.hydra if gh.is_initialized() else None
    gh.clear()
    try:
        yield
    finally:
        gh.clear()
        if saved is not None:
            gh.initialize(saved)


# Config groups whose option an environment variable picks (conf/config.yaml's defaults list reads it through
# ${oc.env:...}); a CLI `group=option` still wins. Checked before Hydra composes, so a bad value names the variable.
GROUP_ENV = {"yoco": "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"}


def check_group_env() -> None:
    """A set variable of GROUP_ENV must name an option of its group: a one-line ConfigError otherwise."""
    import os

    from deepinfer.config.errors import ConfigError

    for group, var in GROUP_ENV.items():
        value = os.environ.get(var)
        if value is not None and value not in group_options(group):
            raise ConfigError(f"{var}={value!r} is not allowed; allowed: {', '.join(group_options(group))}")


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The composed (unresolved) config for these overrides, exactly as `python -m deepinfer OVERRIDES` sees it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    check_group_env()

    with _fresh_global_hydra():
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))
