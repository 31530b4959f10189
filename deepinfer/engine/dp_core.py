"""Rank 0 of a multi-rank layout as the engine-core process sees a core: the data-parallel core beside EngineCore.

The engine-core process (deepinfer.engine.core_process) drives one object with EngineCore's calls (add_request,
abort, has_work, step, info, close). With one rank that is an EngineCore; with several it is a DataParallelCore:
rank 0 of the world, whose every step is one turn of all ranks in lockstep (deepinfer.engine.lockstep says what a
turn is and why every rank must run one). Building a rank's core (rank_core) is shared with the follower ranks,
which the same process module runs in its follower mode.
"""

from __future__ import annotations

import sys
import time

import msgspec
import torch
import torch.distributed as dist

from deepinfer.distributed.world import World, join, leave
from deepinfer.engine import messages as m
from deepinfer.engine.core import EngineCore
from deepinfer.engine.lockstep import Commands, LockstepRank
from deepinfer.engine.messages import AddRequest, CoreOutputs, RequestUpdate

IDLE_TICK_S = 0.1  # rank 0 turns at least this often while idle (it polls the frontend for IDLE_POLL_MS between)


class LockstepError(RuntimeError):
    """A turn failed on rank 0 (a collective with a rank that died or stopped, or a failed step): the run is over.
    The engine-core process reports it to the frontend with its traceback and prints none itself."""

    frontend_reports = True  # read by deepinfer.engine.core_process


class DataParallelCore:
    """Rank 0 as the engine-core process's step loop (core_process._loop) sees an EngineCore: requests go to the
    data-parallel replica with the fewest unfinished ones (ties: the lowest; deterministic for a given order of
    arrivals), every step() is one turn of all ranks, and the updates of all replicas come back in one CoreOutputs.
    The frontend puts the outputs back in submission order.

    A replica is one rank, or with context parallel the cp consecutive ranks of one context-parallel group: each of
    them gets the replica's commands in the same turn, so their engine cores (same deterministic scheduler, same
    cache geometry: rank_core) make the same step plans and sample the same tokens from the same logits; only the
    replica's cp rank 0 reports them."""

    def __init__(self, rank: LockstepRank):
        self.rank = rank
        self.cp = rank.world.cp_size
        n = rank.world.size // self.cp  # replicas
        self._adds: list[list[m.WireRequest]] = [[] for _ in range(n)]
        self._aborts: list[list[int]] = [[] for _ in range(n)]
        self._owner: dict[int, int] = {}  # unfinished request id -> its rank
        self._open = [0] * n  # unfinished requests per rank
        self._next_turn = 0.0
        self._failed = False

    def info(self):
        info = self.rank.core.info()
        w = self.rank.world
        desc = f"rank 0 of {w.size} (each rank its own cache): {info.cache_description}"
        if self.cp > 1:
            desc = (f"rank 0 of {w.size}, context parallel over {self.cp} ranks (each rank the whole caches of the "
                    f"same requests): {info.cache_description}")
        return msgspec.structs.replace(info, cache_description=desc)

    def add_request(self, msg: AddRequest) -> RequestUpdate | None:
        r = min(range(len(self._open)), key=lambda i: (self._open[i], i))
        self._adds[r].append(m.to_wire([msg]).requests[0])
        self._owner[msg.request_id] = r
        self._open[r] += 1
        return None  # the rank answers a request that cannot run, in the next turn's outputs

    def abort(self, request_id: int) -> RequestUpdate | None:
        r = self._owner.get(request_id)
        if r is not None:
            self._aborts[r].append(request_id)
        return None

    def has_work(self) -> bool:
        return (any(self._open) or any(self._aborts) or time.monotonic() >= self._next_turn)

    def step(self) -> CoreOutputs:
        payloads = [msgspec.msgpack.encode(Commands(a, b)) if a or b else b"" for a, b in zip(self._adds, self._aborts)]
        payloads = [p for p in payloads for _ in range(self.cp)]  # every rank of a replica: the replica's commands
        for q in (*self._adds, *self._aborts):
            q.clear()
        try:
            reports = self.rank.turn(payloads)
        except Exception as exc:
            self._failed = True
            raise LockstepError(f"the lockstep step of the {self.rank.world.size} ranks failed (a rank "
                                f"died, stopped or failed): {first_line(exc)}") from exc
        out = CoreOutputs([])
        for rep in reports:
            out.updates += rep.updates
            out.stats += rep.stats
        for upd in out.updates:
            if upd.finish_reason is not None and upd.request_id in self._owner:
                self._open[self._owner.pop(upd.request_id)] -= 1
        self._next_turn = time.monotonic() + IDLE_TICK_S
        return out

    def close(self) -> None:
        """Tells the other ranks to stop (unless a collective already failed), then stops this one."""
        try:
            if not self._failed:
                self.rank.turn([b""] * self.rank.world.size, shutdown=True)
        finally:
            try:
                self.rank.close()
            except Exception:
                if not self._failed:
                    raise  # after a failed turn the step in flight fails too: already reported
            finally:
                leave()


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`: what a rank prints when it cannot go on (the traceback is noise there)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


# ---- building a rank (rank 0 here, the others in core_process's follower mode) ----------------------------------
def rank_core(build, options, world: World, settings) -> tuple[EngineCore, object]:
    """This rank's EngineCore (its model loaded with only its experts by the settings' program) and its EPLB runtime
    (None with eplb.interval 0), after printing the rank's weight memory."""
    # Expert parallel decode steps replay CUDA graphs like single's: the runner agrees every step with the other
    # ranks first and pairs a capture's warm-up collectives (deepinfer.engine.cuda_graphs, model_runner._ep_forward)
    p = settings.parallel
    agree = None
    if world.cp_group is not None:
        def agree(budget: int) -> int:
            """The context-parallel ranks' schedulers must see one cache geometry: the smallest rank's budget."""
            t = torch.tensor([budget], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=world.control)
            return int(t.item())
    core = EngineCore(build, options, agree_budget=agree)
    model = core.backend.model
    print(weights_line(model, world), file=sys.stderr, flush=True)
    eplb = None
    if p.eplb.interval:
        from deepinfer.distributed.eplb_runtime import EplbRuntime

        eplb = EplbRuntime(model, p.eplb.redundant_experts, p.eplb.window, p.eplb.interval, group=world.ep_group)
    return core, eplb


def weights_line(model, world: World) -> str:
    """The rank's weight memory, one line (issue 13: printed by every rank at start)."""
    import os

    total, routed = model.weight_bytes(), model.routed_expert_bytes()
    ep = model.expert_parallel
    slots = (f"{ep.placement.per_rank} of {ep.placement.num_physical} physical expert slots per MoE layer"
             if ep is not None else f"all {model.config.n_routed_experts} experts")
    return (f"deepinfer: rank {world.rank} of {world.size} (pid {os.getpid()}, {world.device}): weights "
            f"{total / 1e9:.4f} GB, of which routed experts {routed / 1e9:.4f} GB ({slots})")


def data_parallel_core(settings, build, options) -> DataParallelCore:
    """Rank 0 of the world of a multi-rank layout (`settings`: the resolved Settings), joined first, as the
    engine-core process's core."""
    world = join(settings.parallel, settings.hardware.device)
    try:
        core, eplb = rank_core(build, options, world, settings)
    except BaseException:
        leave()
        raise
    return DataParallelCore(LockstepRank(core, world, eplb))
