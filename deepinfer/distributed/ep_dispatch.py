"""Static-capacity dispatch and combine for expert parallelism (DeepEP's low-latency mode, in torch collectives):
fixed-size per-peer send and receive buffers, allocated once, and all-to-alls of fixed sizes, so that nothing in
an expert-parallel MoE layer reads a count back to the host and a decode step is captured as a CUDA graph.

Sizing. A rank brings at most `max_tokens` tokens to a static step (the engine: max_num_seqs x the tokens a
sequence decodes per step, 1 + the DSpark draft length). A token sends at most min(top_k, slots per rank) of its
(token, expert) rows to one peer: its experts are distinct, and so are their physical slots. So `capacity`, the rows
per peer, is max_tokens x min(top_k, per_rank): the worst case, not an average with headroom. An overflow then
cannot happen inside a static step: it is a step with more tokens than `max_tokens` on some rank, which every rank
knows before the layer runs, and such a step runs the variable-size path (deepinfer.distributed.expert_parallel:
the row counts exchanged first). Nothing is dropped, and no second pass is needed (a graph replay could not make
one). The knowing: the engine agrees once per step, outside any graph (`agree_step`: one host all-reduce MAX of
[tokens, "I capture"] on a CPU group, no device sync); other callers agree per forward (`agree_static`).
Memory per rank: 3 row buffers x world x capacity rows x hidden (send and receive rows, their outputs back) plus 16
bytes of metadata per row; V4.1-Flash at dep8 with max_num_seqs 256 (hidden 5120, top-6, bf16): 3 x 12288 rows x
10 KB = 377 MB; with 5 DSpark drafts 6x that (tools/parallel_memory.py's column).

Layout. Peer p's rows occupy [p x capacity, (p + 1) x capacity) of every buffer; a rank's rows to one peer are in
(token, choice) order at the front of its segment. Each row's metadata (int64: local slot in the high 32 bits, the
routing weight's fp32 bits in the low 32; UNUSED_META for an unused row: slot -1, weight 0) travels beside it, so
the counts are carried on the device, implicitly. The receiver runs the registered `moe_experts` op over the whole
receive buffer with one expert per row (the local slot, -1 for an unused row: the op skips it) and the outputs go
back in the same positions; the sender reads its rows' outputs at the positions it wrote them.

Collective: `torch.distributed.all_to_all_single` with equal splits (NCCL: grouped send/recv, no host sizes;
gloo: alltoall). Symmetric-memory puts (torch.distributed._symmetric_memory) would save the copy into the send
buffer but need NVLink peers and the NVSHMEM-backed allocator; NVLink multicast stays off on shared machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

UNUSED_META = -(1 << 32)  # an unused row's metadata: slot -1 (high word), weight +0.0 (low word)


def capacity_rows(max_tokens: int, top_k: int, per_rank: int) -> int:
    """Rows per peer that no step of at most `max_tokens` tokens can exceed."""
    if max_tokens < 1 or top_k < 1 or per_rank < 1:
        raise ValueError(f"max_tokens={max_tokens}, top_k={top_k}, per_rank={per_rank}: allowed: each >= 1")
    return max_tokens * min(top_k, per_rank)


@dataclass
class StaticBuffers:
    """The per-rank buffers of the static path, shared by every MoE layer (they run one after another)."""

    max_tokens: int
    capacity: int  # rows per peer
    world: int
    send_x: torch.Tensor  # [world * capacity + 1, D]: the last row takes the writes of no row (a fixed-shape scatter)
    recv_x: torch.Tensor  # [world * capacity, D]
    send_meta: torch.Tensor  # [world * capacity + 1] int64
    recv_meta: torch.Tensor  # [world * capacity] int64
    back: torch.Tensor  # [world * capacity, D]: this rank's rows' outputs, returned

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, per_rank: int, world: int, hidden: int, dtype: torch.dtype,
                 device) -> "StaticBuffers":
        cap = capacity_rows(max_tokens, top_k, per_rank)
        n = world * cap
        rows = dict(dtype=dtype, device=device)
        return cls(max_tokens, cap, world, torch.zeros(n + 1, hidden, **rows), torch.zeros(n, hidden, **rows),
                   torch.full((n + 1,), UNUSED_META, dtype=torch.int64, device=device),
                   torch.full((n,), UNUSED_META, dtype=torch.int64, device=device), torch.zeros(n, hidden, **rows))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.send_x, self.recv_x, self.send_meta, self.recv_meta,
                                                           self.back))

    def fits(self, tokens: int) -> bool:
        return tokens <= self.max_tokens


def agree_static(buffers: StaticBuffers | None, tokens: int, group: dist.ProcessGroup | None) -> bool:
    """Whether this forward's MoE layers take the static path: every rank of the group (a CPU / gloo group of the
    expert-parallel ranks) brings at most `buffers.max_tokens` tokens. One host all-reduce (MAX); every rank must
    call it once per forward, before its first MoE layer."""
    if buffers is None:
        return False
    most = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return buffers.fits(int(most.item()))


@dataclass(frozen=True)
class StepPath:
    """What the expert-parallel ranks agreed for one engine step (`agree_step`): whether every forward of the step
    takes the static path, and how many CUDA-graph captures some rank brings to it (0 or 1: the ranks without one
    run that many extra static forwards first, to join the capturing ranks' warm-up collectives)."""

    static: bool
    captures: int


def agree_step(buffers: StaticBuffers, tokens: int, capture: bool, group: dist.ProcessGroup | None) -> StepPath:
    """The engine's per-step agreement (deepinfer.engine.model_runner, before any forward of the step, outside
    any graph): one host all-reduce (MAX) of [tokens, capture] over the CPU group of the expert-parallel ranks.
    `tokens`: the rows this rank's forward runs (a replayed graph's padded bucket); `capture`: this rank will
    capture a decode graph in this step. A step that is not static captures nothing (a capture's forwards are
    static ones)."""
    most = torch.tensor([tokens, int(capture)], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    static = buffers.fits(int(most[0]))
    return StepPath(static, int(most[1]) if static else 0)


def send_rows(dest: torch.Tensor, world: int, capacity: int) -> torch.Tensor:
    """[n] destination rank of each (token, choice) row, in that order -> its row in the send buffer: the peer's
    segment start plus the row's place among the rows to that peer (fixed shapes: a one-hot running count)."""
    running = (dest[:, None] == torch.arange(world, device=dest.device)).long().cumsum(0)
    place = running.gather(1, dest[:, None]).squeeze(1) - 1
    return dest * capacity + place


def dispatch_static(buffers: StaticBuffers, x: torch.Tensor, k: int, meta: torch.Tensor,
                    row: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's row x[t] (k times: once per choice) with the choices' metadata into the send buffer at `row`
    ([T * k], (token, choice) order), the rest marked unused, then the fixed all-to-alls. Returns (received rows
    [world * capacity, D], their metadata, UNUSED_META for an unused row)."""
    b = buffers
    b.send_meta.fill_(UNUSED_META)
    b.send_x.index_put_((row.view(-1, k),), x[:, None, :].expand(-1, k, -1))  # one kernel, no [T * k, D] copy
    b.send_meta.index_copy_(0, row, meta)
    n = b.world * b.capacity
    dist.all_to_all_single(b.recv_x, b.send_x[:n], group=group)
    dist.all_to_all_single(b.recv_meta, b.send_meta[:n], group=group)
    return b.recv_x, b.recv_meta


def combine_static(buffers: StaticBuffers, out: torch.Tensor, row: torch.Tensor,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """The received rows' outputs (`out`, in receive-buffer order) back to their senders; returns [n, D], the
    output of each row this rank sent, in the order of `row`."""
    dist.all_to_all_single(buffers.back, out, group=group)
    return buffers.back.index_select(0, row)
