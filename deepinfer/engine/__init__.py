"""The engine: continuous batching over the model.

Rooms (ARCHITECTURE.md §4): Scheduler and CacheManager (pure Python), ModelRunner (the only room touching
tensors), EngineCore (the step loop, synchronous or zero-overhead), and the clients that reach the core in its own
process over private ipc sockets (or in-process). With a multi-rank layout: the data-parallel client
(dp_client), rank 0's DataParallelCore (dp_core) turning every rank in lockstep (lockstep), the other ranks in the
core process's follower mode (core_process). make_client picks the client for LLM and the server alike. The
frontend above it (LLMEngine, AsyncEngine) is deepinfer.frontend.
"""

from deepinfer.engine.backend import EngineBackend, SettingsBackend, backend_from_model
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
    "Scheduler",
    "SettingsBackend",
    "backend_from_model",
]
