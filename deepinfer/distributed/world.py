"""One process's place in a multi-rank layout: joining the world and its process groups.

A rank is a process started with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
by `torchrun` itself across machines, or by deepinfer.engine.dp_client, which sets the same variables for the ranks
it starts on this machine. Either way the rank joins with init_method "env://" and gets:
  - the default (world) group on the device's backend (NCCL on CUDA, gloo on the CPU: deepinfer.distributed.groups);
  - `control`, a gloo group on the CPU for the lockstep loop's small messages (deepinfer.engine.lockstep). It is
    separate because the loop's collectives run on the engine's loop thread while the model's all-to-alls run on
    its device thread: two threads issuing collectives on one group could interleave differently on different
    ranks, and then they would match the wrong partners;
  - `ep_group`, the ranks that share the routed experts (consecutive runs of expert_parallel_size ranks,
    deepinfer.config.layout.expert_groups; the world itself when EP spans it);
  - `cp_group`, the context-parallel ranks of this rank's replica: consecutive runs of context_parallel_size ranks
    (DeepInfer's rank = engine_rank * cp + cp_rank), the world itself when there is one replica.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from deepinfer.config.errors import ConfigError
from deepinfer.config.layout import expert_groups

from . import groups

if TYPE_CHECKING:
    from deepinfer.config.schema import ParallelSettings

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started as one rank of several (torchrun, or our launcher: RANK and
    WORLD_SIZE set, WORLD_SIZE > 1); None otherwise."""
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or size is None:
        return None
    try:
        r, n = int(rank), int(size)
    except ValueError:
        raise ConfigError(f"RANK={rank!r} WORLD_SIZE={size!r}: allowed: integers (as torchrun sets them)") from None
    return (r, n) if n > 1 else None


def check_launch(parallel: ParallelSettings) -> tuple[int, int] | None:
    """The launched (rank, world size), checked against the layout: a one-line ConfigError when torchrun started a
    different number of processes than the layout has ranks."""
    launched = launched_rank()
    if launched is None:
        return None
    rank, size = launched
    if size != parallel.world_size:
        raise ConfigError(f"WORLD_SIZE={size} processes were started (torchrun) but parallel={parallel.name} has "
                          f"{parallel.world_size} ranks (context x data parallel); allowed: --nproc-per-node x "
                          f"--nnodes = {parallel.world_size}")
    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"RANK={rank} is set but {', '.join(missing)} are not; allowed: start the ranks with torchrun "
                          "(or with `python -m deepinfer parallel=...` alone on one machine)")
    if os.environ["MASTER_PORT"].strip() in ("", "0"):  # torchrun --master-port 0 hands every rank port 0
        raise ConfigError(f"MASTER_PORT={os.environ['MASTER_PORT']!r}: the ranks cannot meet on port 0; allowed: a "
                          "port number (torchrun --master-port N, or torchrun --standalone on one machine)")
    return launched


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: str  # "cpu", or "cuda" with torch.cuda.set_device(local_rank) done
    parallel: ParallelSettings  # resolved
    control: dist.ProcessGroup
    ep_group: dist.ProcessGroup | None  # None: expert_parallel_size 1 (every rank holds every expert)
    ep_rank: int
    cp_group: dist.ProcessGroup | None = None  # the context-parallel group (the world: one replica), None: cp 1
    # a gloo group of the same ranks as ep_group, for the host-side agreement each forward starts with
    # (ExpertParallel.begin_forward); None: ep_group itself is gloo (the CPU) or there is none
    ep_agree_group: dist.ProcessGroup | None = None

    @property
    def cp_size(self) -> int:
        return self.parallel.context_parallel_size

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group (DeepInfer: rank = engine_rank * cp + cp_rank)."""
        return self.rank % self.cp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


_current: World | None = None


def current() -> World | None:
    """The world this process joined (None: not a rank of a multi-rank layout)."""
    return _current


def join(parallel: ParallelSettings, device: str) -> World:
    """Join the world as torchrun's environment says (see the module docstring); the collectives raise after
    parallel.timeout seconds instead of hanging."""
    global _current
    launched = check_launch(parallel)
    if launched is None:
        raise ConfigError(f"parallel={parallel.name} needs its ranks started together: RANK and WORLD_SIZE are not set "
                          "(use `python -m deepinfer parallel=...` or torchrun)")
    rank, size = launched
    local = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local} but this machine has {torch.cuda.device_count()} CUDA devices; "
                              f"allowed: at most one rank per GPU")
        torch.cuda.set_device(local)
    groups.init_group(rank, size, "env://", device, timeout_s=parallel.timeout)
    timeout = timedelta(seconds=parallel.timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    ep = parallel.expert_parallel_size
    ep_group = ep_agree = None
    if ep > 1:
        ranks = expert_groups(size, ep)
        if len(ranks) == 1:
            ep_group = dist.group.WORLD
        else:
            made = [dist.new_group(r, timeout=timeout) for r in ranks]  # every rank creates every group, in order
            ep_group = made[rank // ep]
        if device == "cuda":  # the agreement is a host collective: never a device sync
            agree = [dist.new_group(r, timeout=timeout, backend="gloo") for r in ranks]
            ep_agree = agree[rank // ep]
    # context parallel: each data-parallel replica is a run of cp consecutive ranks (with expert parallel over cp
    # ranks, the same ranks as its EP group)
    cp = parallel.context_parallel_size
    cp_group = None
    if cp > 1:
        if size == cp:
            cp_group = dist.group.WORLD
        else:
            made = [dist.new_group(list(range(i * cp, (i + 1) * cp)), timeout=timeout) for i in range(size // cp)]
            cp_group = made[rank // cp]
    _current = World(rank, size, local, device, parallel, control, ep_group, rank % ep, cp_group, ep_agree)
    return _current


def leave() -> None:
    """Leave the world (no collective: safe after a rank died)."""
    global _current
    _current = None
    groups.destroy()

