"""The arithmetic of a parallel layout (no torch, so the config's resolve step can use it): how many ranks, which
ranks share their experts, and which parts of the layouts the engine can run today.

Ranks are numbered as DeepInfer numbers them (worker/base.py: rank = engine_rank * cp + cp_rank): a world of
context_parallel_size x data_parallel_size ranks, each group of expert_parallel_size consecutive ranks holding one
copy of every routed expert between them.
"""

from __future__ import annotations

import importlib.util


def resolved_data_parallel_size(data_parallel_size: int, expert_parallel_size: int, context_parallel_size: int) -> int:
    """DeepInfer's rule (config.py ParallelConfig): data_parallel_size 0 means expert / context parallel size,
    at least 1."""
    if data_parallel_size:
        return data_parallel_size
    return max(1, expert_parallel_size // context_parallel_size)


def expert_groups(world_size: int, expert_parallel_size: int) -> list[list[int]]:
    """The ranks of each expert-parallel group: consecutive runs of expert_parallel_size ranks."""
    ep = expert_parallel_size
    return [list(range(g * ep, (g + 1) * ep)) for g in range(world_size // ep)]


def context_parallel_runnable() -> bool:
    """THE HOOK for balanced context parallelism in the engine. The model side is being built in
    deepinfer/parallel/context_parallel.py; the engine side is not: the lockstep loop (deepinfer/parallel/lockstep.py)
    gives every rank its own requests, while the context_parallel_size ranks of one data-parallel rank would have
    to take the same requests and prefill a mirror-split share of each. Until that exists this returns False and
    the resolve step refuses context_parallel_size > 1 instead of running it as something else."""
    return False


def eplb_runtime_available() -> bool:
    """Whether the EPLB re-placement runtime (deepinfer/parallel/eplb_runtime.py, EplbRuntime) is installed; the
    resolve step refuses eplb.interval > 0 without it."""
    return importlib.util.find_spec("deepinfer.parallel.eplb_runtime") is not None
