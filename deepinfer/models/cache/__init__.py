"""The runner-owned cache pools in the released formats, and the per-step metadata every layer reads."""

from .metadata import HostStep, StepMeta, derive, pack_step
from .pools import CacheLayout, CachePools, SequenceCache, StandaloneAllocator

__all__ = ["CacheLayout", "CachePools", "HostStep", "SequenceCache", "StandaloneAllocator", "StepMeta", "derive",
           "pack_step"]
