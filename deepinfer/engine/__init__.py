"""The engine: continuous batching over the model.

Rooms (ARCHITECTURE.md §4): Scheduler and CacheManager (pure Python), ModelRunner (the only room touching
tensors), EngineCore (the step loop, synchronous or zero-overhead), and the clients that reach the core in its own
process over private ipc sockets (or in-process). The frontend above it (LLMEngine, AsyncEngine) is
deepinfer.frontend.
"""

from deepinfer.engine.backend import (
    EngineBackend,
    ImportedBackend,
    ModelDirBackend,
    SettingsBackend,
    backend_from_model,
    backend_from_program,
)
from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.client import EngineDeadError
from deepinfer.engine.core import EngineCore
from deepinfer.engine.options import EngineOptions
from deepinfer.engine.scheduler import Scheduler

__all__ = [
    "CacheManager",
    "EngineBackend",
    "EngineCore",
    "EngineDeadError",
    "EngineOptions",
    "ImportedBackend",
    "ModelDirBackend",
    "Scheduler",
    "SettingsBackend",
    "backend_from_model",
    "backend_from_program",
]
