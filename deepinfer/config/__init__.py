"""Configuration: the typed schema (schema.py), Hydra composition (compose.py) and the one resolve step
(resolve.py) that turns a composed config into frozen settings. Engine code imports the settings classes:

    from deepinfer.config import Settings, EngineSettings, CacheSettings, RuntimeSettings, SamplingDefaults
"""

from deepinfer.config import resolvers
from deepinfer.config.errors import ConfigError
from deepinfer.config.schema import (
    CacheSettings,
    DecodingSettings,
    EngineSettings,
    HardwareSettings,
    ModelSettings,
    ParallelSettings,
    PipelineSettings,
    RuntimeSettings,
    SamplingDefaults,
    Settings,
    StageSpec,
    YocoSettings,
)

resolvers.register()

__all__ = [
    "CacheSettings",
    "ConfigError",
    "DecodingSettings",
    "EngineSettings",
    "HardwareSettings",
    "ModelSettings",
    "ParallelSettings",
    "PipelineSettings",
    "RuntimeSettings",
    "SamplingDefaults",
    "Settings",
    "StageSpec",
    "YocoSettings",
]
