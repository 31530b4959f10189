"""Static-capacity dispatch and combine for expert parallelism (DeepEP's low-latency mode, in torch collectives):
fixed-size per-peer send and receive buffers, allocated once, and all-to-alls of fixed sizes, so that nothing in
an expert-parallel MoE layer reads a count back to the host and a decode step is captured as a CUDA graph.

Sizing. A rank brings at most `max_tokens` tokens to a static step (the engine: max_num_seqs x the tokens a
sequence decodes per step, 1 + the DSpark draft length). A token sends at most min(top_k, slots per rank) of its
(token, expert) rows to one peer: its experts are distinct, and so are their physical slots. So the buffers hold
max_tokens x min(top_k, per_rank) rows per peer: the worst case, not an average with headroom. An overflow then
cannot happen inside a static step: it is a step with more tokens than `max_tokens` on some rank, which every rank
knows before the layer runs, and such a step runs the variable-size path (deepinfer.distributed.expert_parallel:
the row counts exchanged first). Nothing is dropped, and no second pass is needed (a graph replay could not make
one). The knowing: the engine agrees once per step, outside any graph (`agree_step`: one host all-reduce MAX on a
CPU group, no device sync); other callers agree per forward (`agree_static`).

Capacity per step. The buffers are allocated once at the maximum, but a step uses views of them (`at`) sized for
the agreed token count T (the largest rank's) rounded up to a bucket (`buckets`: the engine's CUDA-graph batch
buckets, in tokens; None: T itself), capacity = T x min(top_k, per_rank) rows per peer. Every piece of the static
path scales with those rows, used or not (the send buffer's reset, the all-to-alls, the op over the receive
buffer: its routing-table scan, output zeroing and cast, the combine), so buffers sized for max_num_seqs made a
one-token step 3.3x slower than `single` on an H200 (benchmarks/results/ep_gpu_h200.json). The ranks must use the
same capacity (equal splits), hence the agreement; a CUDA graph bakes in the views it was captured with, so the
engine keys its decode graphs by the capacity too (engine/cuda_graphs.py).

Memory per rank (allocated at the maximum): 3 row buffers x world x capacity rows x hidden (send and receive rows,
their outputs back) plus 16 bytes of metadata per row; V4.1-Flash at dep8 with max_num_seqs 256 (hidden 5120,
top-6, bf16): 3 x 12288 rows x 10 KB = 377 MB; with 5 DSpark drafts 6x that (tools/parallel_memory.py's column).

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

from dataclasses import dataclass, field

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
    """The per-rank buffers of the static path, shared by every MoE layer (they run one after another). Allocated at
    the maximum (`allocate`); `at(tokens)` gives the same class over views of them sized for a step of `tokens`."""

    max_tokens: int
    capacity: int  # rows per peer
    world: int
    send_x: torch.Tensor  # [world * capacity, D]
    recv_x: torch.Tensor  # [world * capacity, D]
    send_meta: torch.Tensor  # [world * capacity] int64
    recv_meta: torch.Tensor  # [world * capacity] int64
    back: torch.Tensor  # [world * capacity, D]: this rank's rows' outputs, returned
    # token counts a step's capacity is rounded up to (ascending, the last max_tokens; set_buckets), None: none
    buckets: tuple[int, ...] | None = None
    _views: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, per_rank: int, world: int, hidden: int, dtype: torch.dtype,
                 device) -> "StaticBuffers":
        cap = capacity_rows(max_tokens, top_k, per_rank)
        n = world * cap
        rows = dict(dtype=dtype, device=device)
        return cls(max_tokens, cap, world, torch.zeros(n, hidden, **rows), torch.zeros(n, hidden, **rows),
                   torch.full((n,), UNUSED_META, dtype=torch.int64, device=device),
                   torch.full((n,), UNUSED_META, dtype=torch.int64, device=device), torch.zeros(n, hidden, **rows))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.send_x, self.recv_x, self.send_meta, self.recv_meta,
                                                           self.back))

    def fits(self, tokens: int) -> bool:
        return tokens <= self.max_tokens

    def set_buckets(self, buckets) -> None:
        """Round every step's capacity up to one of `buckets` (token counts; the engine: its decode graphs' batch
        buckets in tokens, so that a graph's capacity is one the ranks can agree on). Every rank sets the same."""
        b = tuple(sorted(set(int(t) for t in buckets)))
        if not b or b[0] < 1 or b[-1] != self.max_tokens:
            raise ValueError(f"buckets {b}: allowed: token counts >= 1, the largest {self.max_tokens} (max_tokens)")
        self.buckets = b

    def bucket(self, tokens: int) -> int:
        """The tokens a step of `tokens` (the largest rank's) sizes its capacity for: the smallest bucket that holds
        it (tokens itself without buckets; at least 1); 0 when it does not fit (the variable path)."""
        if not self.fits(tokens):
            return 0
        tokens = max(1, tokens)
        return tokens if self.buckets is None else next(b for b in self.buckets if b >= tokens)

    def at(self, tokens: int) -> "StaticBuffers":
        """The buffers for a step of at most `tokens` tokens a rank (an agreed `bucket`): views of the first
        world x capacity rows of each buffer, capacity = tokens x the rows a token sends a peer at most. Every
        rank of a step must take the same `tokens` (the all-to-alls split the rows equally)."""
        if not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"a step of {tokens} tokens: the buffers hold 1..{self.max_tokens}")
        if tokens == self.max_tokens:
            return self
        view = self._views.get(tokens)
        if view is None:  # kept: a graph captured with these views reads them at every replay anyway
            cap = tokens * (self.capacity // self.max_tokens)
            n = self.world * cap
            view = self._views[tokens] = StaticBuffers(tokens, cap, self.world, self.send_x[:n], self.recv_x[:n],
                                                       self.send_meta[:n], self.recv_meta[:n], self.back[:n])
        return view


def agree_static(buffers: StaticBuffers | None, tokens: int, group: dist.ProcessGroup | None) -> int:
    """The tokens this forward's static buffers are sized for (`buffers.bucket` of the largest rank's), 0: its MoE
    layers take the variable path (some rank brings more than `buffers.max_tokens`). One host all-reduce (MAX) on
    `group` (a CPU / gloo group of the expert-parallel ranks); every rank must call it once per forward, before its
    first MoE layer."""
    if buffers is None:
        return 0
    most = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    return buffers.bucket(int(most.item()))


@dataclass(frozen=True)
class StepPath:
    """What the expert-parallel ranks agreed for one engine step (`agree_step`): whether every forward of the step
    takes the static path, how many CUDA-graph captures some rank brings to it (0 or 1: the ranks without one
    run that many extra static forwards first, to join the capturing ranks' warm-up collectives), and the tokens
    the step's static buffers are sized for (StaticBuffers.bucket; 0 when not static)."""

    static: bool
    captures: int
    tokens: int = 0


def agree_step(buffers: StaticBuffers, tokens: int, captures: list[bool], group: dist.ProcessGroup | None
               ) -> StepPath:
    """The engine's per-step agreement (deepinfer.engine.model_runner, before any forward of the step, outside
    any graph): one host all-reduce (MAX) of [tokens, captures...] over the CPU group of the expert-parallel ranks.
    `tokens`: the rows this rank's forward runs (a replayed graph's padded bucket); `captures`: per bucket of
    `buffers.buckets` (empty, or as long as the buckets), whether this rank would capture a decode graph in this
    step were that the step's capacity (a graph bakes in its capacity: which one needs a capture is known only once
    the ranks agree the tokens, so every candidate travels in the same all-reduce). A step that is not static
    captures nothing (a capture's forwards are static ones)."""
    width = len(buffers.buckets or ())
    if captures and len(captures) != width:
        raise ValueError(f"{len(captures)} capture flags for {width} buckets")
    most = torch.tensor([tokens] + [int(c) for c in captures] + [0] * (width - len(captures)), dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    sized = buffers.bucket(int(most[0]))
    if not sized:
        return StepPath(False, 0)
    at = buffers.buckets.index(sized) if buffers.buckets else None
    return StepPath(True, int(most[1 + at]) if at is not None else 0, sized)


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
    b.send_meta.fill_(UNUSED_META)  # the step's rows only (a view: `at`)
    b.send_x.index_put_((row.view(-1, k),), x[:, None, :].expand(-1, k, -1))  # one kernel, no [T * k, D] copy
    b.send_meta.index_copy_(0, row, meta)
    dist.all_to_all_single(b.recv_x, b.send_x, group=group)
    dist.all_to_all_single(b.recv_meta, b.send_meta, group=group)
    return b.recv_x, b.recv_meta


def combine_static(buffers: StaticBuffers, out: torch.Tensor, row: torch.Tensor,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """The received rows' outputs (`out`, in receive-buffer order) back to their senders; returns [n, D], the
    output of each row this rank sent, in the order of `row`."""
    dist.all_to_all_single(buffers.back, out, group=group)
    return buffers.back.index_select(0, row)
