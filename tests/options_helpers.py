"""EngineOptions for tests that run an engine without a config: the schema's defaults (deepinfer/config/schema.py,
the one place for them) through EngineOptions' one constructor, then the fields a test sets by name."""

from deepinfer.config.schema import Settings
from deepinfer.engine.options import EngineOptions


def engine_options(**overrides) -> EngineOptions:
    return EngineOptions.for_settings(Settings(), **overrides)
