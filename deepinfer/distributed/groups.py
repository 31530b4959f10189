"""torch.distributed process groups for the parallel layouts: NCCL on CUDA devices, gloo on the CPU (so every
layout can be tested with a few CPU processes). One default (world) group per process; the expert-parallel
collectives take it, or a sub-group, as `group`."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: str | torch.device) -> str:
    """"nccl" for a CUDA device, "gloo" for the CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"no process-group backend for device {kind!r}; allowed: cuda (nccl), cpu (gloo)")


def init_group(rank: int, world_size: int, init_method: str, device: str | torch.device = "cpu",
               timeout_s: float = 60.0) -> dist.ProcessGroup:
    """Join the default process group as `rank` of `world_size` (init_method: "tcp://127.0.0.1:PORT",
    "file:///path", or "env://" under torchrun). A collective that waits longer than `timeout_s` raises
    instead of hanging the run."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is out of range; allowed: 0..{world_size - 1}")
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this process")
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return dist.group.WORLD


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in `group` (the world by default); 1 when no process group is initialised (the single layout)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the world by default); 0 when no process group is initialised."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def destroy() -> None:
    """Leave the default process group (no-op when none)."""
    if dist.is_initialized():
        dist.destroy_process_group()
