"""The runner-owned cache pools in the released formats, and the per-step metadata every layer reads."""

from .metadata import (EntryIndex, HostStep, ImageRows, PrefillWindow, Selection, StepMeta, WindowIndex, derive,
                       pack_step, query_view)
from .pools import CacheLayout, CachePools, SequenceCache, StandaloneAllocator

__all__ = ["CacheLayout", "CachePools", "EntryIndex", "HostStep", "ImageRows", "PrefillWindow", "Selection",
           "SequenceCache", "StandaloneAllocator",
           "StepMeta", "WindowIndex", "derive", "pack_step", "query_view"]
