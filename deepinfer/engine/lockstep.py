"""Data-parallel ranks in lockstep: one engine core per rank, every rank running one model forward per step.
This module is one rank's side of a turn (LockstepRank); rank 0's view of all ranks as one core is
deepinfer.engine.dp_core.DataParallelCore.

With expert parallelism every MoE layer is a collective (an all-to-all over the EP group), so every rank must run
the same number of forwards in the same order, whatever its own requests. Rank 0 (the driver) is the engine-core
process the frontend talks to; it spreads the requests over the ranks and returns every rank's outputs. One turn
of the loop, on every rank, over the `control` group (gloo, CPU; deepinfer.distributed.world says why it is a group
of its own):

  1. commands: rank 0 broadcasts each rank's payload size, then scatters the payloads (new requests, aborts; all
     sizes -1: shut down). Payloads are MessagePack of the engine's own typed messages, never pickle;
  2. every rank adds / aborts its own, then an all-reduce (MAX) of "has work": the ranks agree whether anybody has
     anything to run. Nobody: no forward this turn. Somebody: every rank steps; a rank without work runs a dummy
     forward (EngineCore.idle_step) that joins the collectives, as DeepInfer's idle ranks do;
  3. after the forward, EPLB's `after_step` on every rank (eplb.interval > 0; it has collectives of its own), queued
     on the device thread behind the forward;
  4. outputs: an all-gather of the sizes, then a gather of each rank's updates to rank 0.
Termination is the same agreement: once no rank has work, turns run no forward; rank 0 turns only when a request
arrives or every dp_core.IDLE_TICK_S (the other ranks wait in step 1 meanwhile, well inside the collective timeout).

Context parallel (parallel=cp2 / cp4; deepinfer.config.layout.context_parallel_refusal says what is refused): the
world is data_parallel_size replicas of cp consecutive ranks. Rank 0 sends every rank of a replica the same commands
in the same turn, and every rank of it runs an identical EngineCore on them: the scheduler is deterministic given the
same requests in the same order and the same cache geometry (dp_core.rank_core makes the ranks agree on the smallest
cache budget), grammars are compiled before add_request returns (EngineCore.enter_lockstep(cp)), and sampling is
seeded per request and position on logits that the context-parallel forward makes identical on every rank. So the step
plans and tokens are the same everywhere without shipping plans, whose rows carry per-process objects (grammar
matchers, sequence states). Prefill steps run model.forward(batch, cp=ContextParallel(world.cp_group)) (each rank its
mirror blocks, every rank's pools the whole chunk); decode steps run whole on every rank, which keeps every rank's
caches complete for later prefill chunks and joins the MoE all-to-alls when the experts are sharded over the same
ranks. Only cp rank 0 reports outputs.

A rank that dies makes the others' next collective fail (gloo: the peer's connection closes; a rank that stops
answering: parallel.timeout). Rank 0 reports it as the core's failure; the frontend (dp_client.py) names the rank that
exited and ends the run. The ranks' batches differ, so each row's output depends only on its own tokens: greedy
tokens equal `single`'s where the model is row-invariant (the torch CPU path: tests/test_parallel_engine.py).
"""

from __future__ import annotations

import sys

import msgspec
import torch
import torch.distributed as dist

from deepinfer.distributed.world import World
from deepinfer.engine import messages as m
from deepinfer.engine.core import EngineCore
from deepinfer.engine.messages import AddRequest, CoreOutputs, RequestUpdate

SHUTDOWN = object()


class Commands(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's share of a turn: requests (as they travel from the frontend, checked again on arrival) and aborts."""

    adds: list[m.WireRequest] = msgspec.field(default_factory=list)
    aborts: list[int] = msgspec.field(default_factory=list)


_commands = msgspec.msgpack.Decoder(Commands)
_outputs = msgspec.msgpack.Decoder(CoreOutputs)


class LockstepRank:
    """One rank's side of the loop above, around its EngineCore."""

    def __init__(self, core: EngineCore, world: World, eplb=None):
        cp = None
        if world.cp_group is not None:
            from deepinfer.distributed.context_parallel import ContextParallel

            cp = ContextParallel(world.cp_group)
        core.enter_lockstep(cp)
        self.core, self.world, self.eplb = core, world, eplb
        # context parallel: the ranks of a replica hold identical cores, so only its cp rank 0 reports outputs
        self.reports = world.cp_group is None or world.cp_rank == 0
        # every rank has loaded its share before rank 0 reports ready: the first turn then waits for nobody's loading
        dist.barrier(group=world.control)

    def turn(self, payloads: list[bytes] | None = None, shutdown: bool = False):
        """One turn. Rank 0 passes every rank's command payload (b"": none) and gets every rank's CoreOutputs;
        the other ranks pass nothing and get None, or SHUTDOWN when rank 0 ends the run."""
        mine = self._commands(payloads, shutdown)
        if mine is SHUTDOWN:
            return SHUTDOWN
        out = CoreOutputs(self._apply(mine))
        if self._anybody(self.core.has_work()):
            step = self.core.step() if self.core.has_work() else self.core.idle_step()
            out.updates += step.updates
            out.stats += step.stats
            if self.eplb is not None:
                self.core.on_device(self._after_step)
        report = self.reports and (out.updates or out.stats)
        return self._gather(msgspec.msgpack.encode(out) if report else b"")

    def _after_step(self) -> None:
        """EPLB after the forward, on the device thread; rank 0 prints a re-placement's line (imbalance before and
        after): the engine-core processes have no log handler of their own."""
        done = self.eplb.after_step()
        if done is not None and self.world.is_driver:
            print(f"deepinfer: {done.log_line()}", file=sys.stderr, flush=True)

    # ---- the three exchanges -------------------------------------------------------------------------------
    def _commands(self, payloads, shutdown: bool):
        w = self.world
        sizes = torch.zeros(w.size, dtype=torch.int64)
        if w.is_driver:
            sizes = torch.full((w.size,), -1, dtype=torch.int64) if shutdown else \
                torch.tensor([len(p) for p in payloads], dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=w.control)
        if sizes[0].item() < 0:
            return SHUTDOWN
        width = int(sizes.max().item())
        if width == 0:
            return b""
        buf = torch.empty(width, dtype=torch.uint8)
        chunks = [_padded(p, width) for p in payloads] if w.is_driver else None
        dist.scatter(buf, chunks, src=0, group=w.control)
        return bytes(buf[: sizes[w.rank].item()].numpy())

    def _anybody(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world.control)
        return bool(flag.item())

    def _gather(self, data: bytes):
        w = self.world
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(w.size)]
        dist.all_gather(sizes, size, group=w.control)
        lengths = [int(s.item()) for s in sizes]
        width = max(lengths)
        got = [b""] * w.size
        if width:
            bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(w.size)] if w.is_driver else None
            dist.gather(_padded(data, width), bufs, dst=0, group=w.control)
            if w.is_driver:
                got = [bytes(b[:n].numpy()) for b, n in zip(bufs, lengths)]
        if not w.is_driver:
            return None
        return [_outputs.decode(g) if g else CoreOutputs([]) for g in got]

    def _apply(self, payload: bytes) -> list[RequestUpdate]:
        if not payload:
            return []
        cmd = _commands.decode(payload)
        updates = []
        for wire in cmd.adds:
            req = m.from_wire(wire)  # a malformed request ends alone, with its one-line error
            upd = self.core.add_request(req) if isinstance(req, AddRequest) else req
            if upd is not None:
                updates.append(upd)
        updates += [u for u in map(self.core.abort, cmd.aborts) if u is not None]
        return updates

    def close(self) -> None:
        self.core.close()


def _padded(data: bytes, width: int) -> torch.Tensor:
    out = torch.zeros(width, dtype=torch.uint8)
    if data:
        out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def follow(rank: LockstepRank) -> None:
    """A rank other than 0: turn until rank 0 says stop (a failed collective raises)."""
    while rank.turn() is not SHUTDOWN:
        pass
