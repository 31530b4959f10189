"""Expert-parallel MoE over torch.distributed: each rank holds its own tokens (attention data parallel) and the
routed experts of its physical slots (ExpertPlacement); a token's hidden state travels to the ranks that own the
experts it chose, is computed there, and comes back to be summed on its own rank.

Two dispatch paths, one expert computation:
  * static (deepinfer.distributed.ep_dispatch: fixed-size per-peer buffers allocated once, equal-split
    all-to-alls, the counts carried on the device as unused-row markers). Taken when the ranks agreed, once per
    forward (`ExpertParallel.begin_forward`), that every rank's step fits the buffers: decode steps. Each forward
    uses views of the buffers sized for the largest rank's tokens rounded up to a bucket (the agreed capacity).
    Nothing is read back to the host, so such a step is captured as a CUDA graph (deepinfer.engine.cuda_graphs): the
    engine agrees the path and capacity once per step, outside any graph (`ExpertParallel.agree_step`), and pins
    them for the step's forwards.
  * variable: `all_to_all_single` with data-dependent splits; the per-peer row counts are exchanged first (a
    [world] all-to-all) and read on the host (one device sync per layer). Prefill steps, and every step of a model
    without static buffers. Why all-to-all: every rank sends a different number of rows to every other rank and
    receives rows from all of them in one step; an all-gather would ship every token to every rank.
  Either way the received rows go through the registered `moe_experts` op (`experts_op`: the TileLang grouped GEMM
  over PackedExperts on CUDA, the torch op elsewhere) with one expert per row, the rank's local slot (incl.
  redundant EPLB copies): no per-call dequantisation loop here. Every rank calls every collective, also with zero
  tokens (the collectives need all ranks; DeepInfer's idle ranks run dummy steps for the same reason).

Exactness: the sum over a token's experts runs on the token's own rank in ascending logical expert id, starting
from fp32 zeros, then the shared expert, then the cast: the accumulation order of the single-process op
(deepinfer.kernels.torch.moe.moe_experts, CPU path: `for e in torch.unique(idx)`). Each row's expert output is the
op's bf16/fp32 result of `swiglu_expert`, which is row-invariant on the CPU (kernels/torch/linear.py pads rows to a
fixed tile; elementwise.py keeps every element on the SIMD path), so a row's output does not depend on which other
rows share the call: both paths are bitwise equal to the single-process op on the CPU. On CUDA the GEMMs' tiles
follow the row count, so only the batch-invariant mode gives bitwise agreement: there the TileLang op keeps each
(token, expert) output as its own bf16-rounded row and sums them in the same order (kernels/tilelang/moe.py
`_moe_experts_invariant`), and the shared expert goes through the op's own shared pass (`_shared`), so each term
is the same bits and the sum is the same sum.

Replica choice: a (token, expert) pair with c copies goes to copy `(token index + source rank) % c`, a fixed rule
that spreads a hot expert's tokens over its copies. DeepInfer picks the copy inside its compiled gate kernel
(`to_physical_map` / `logical_count` arguments, not in the sdist's Python), so its exact rule is not followed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.kernels.packed_experts import PackedExperts
from deepinfer.kernels.registry import no_host_reads
from deepinfer.kernels.torch.moe import moe_experts as torch_moe_experts

from .ep_dispatch import StaticBuffers, StepPath, agree_static, agree_step, combine_static, dispatch_static, send_rows
from .placement import ExpertPlacement

Experts = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | PackedExperts


@dataclass
class ExpertParallel:
    """A model's expert-parallel mode (`DeepseekV41Model.expert_parallel`, set by `load_model(expert_placement=...,
    ep_rank=..., ep_group=...)`): this process is `rank` of `group` (None: the default world group), holds the routed
    experts of its physical slots under `placement` (the load-time placement, one for every MoE layer of the
    backbone), and each MoE layer runs `ep_moe_experts` on the rank's own tokens; the router, attention and
    everything else stay local.

    Every MoE layer is a collective over `group`: every rank must call `model.forward` the same number of times, in
    step with the others (a rank with nothing to run must still run a step; the ranks' batches may differ in size
    and content). A rank that skips or adds a forward leaves the others waiting in the all-to-all until the
    group's timeout.

    EPLB (deepinfer.distributed.eplb_runtime.EplbRuntime) installs the per-layer state below: each MoE layer's own
    placement (re-placed over time), its dispatch table on the device (built once, rewritten in place) and the
    per-slot token counts of the current step (a preallocated device buffer the MoE step adds to). Without it
    every layer uses `placement`, the table is built per call and nothing is counted."""

    placement: ExpertPlacement
    rank: int
    group: dist.ProcessGroup | None = None
    layer_placements: list[ExpertPlacement] | None = None
    replicas: torch.Tensor | None = None  # [L, E, C] int64: physical slots of each logical expert (choose_copies)
    copies: torch.Tensor | None = None  # [L, E] int64: how many of those are real
    load: torch.Tensor | None = None  # [L, per_rank] int64: rows each local slot computed in the current step
    # static-capacity dispatch (plan_static): the buffers (allocated at the maximum), the CPU (gloo) group of these
    # ranks the per-forward agreement runs on (None: `group`, which is then gloo), and this forward's views of the
    # buffers, sized for the agreed tokens (None: this forward takes the variable path)
    buffers: StaticBuffers | None = None
    agree_group: dist.ProcessGroup | None = None
    step_buffers: StaticBuffers | None = None
    # the path the engine agreed for the current step (agree_step + pin): the step's forwards take it without a
    # collective of their own (a replayed graph runs none); None: each forward agrees (begin_forward)
    pinned: StepPath | None = None
    # `placement`'s replica table on the device (plan_static): a graph cannot copy a host-built one in
    static_replicas: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan_static(self, max_tokens: int, top_k: int, hidden: int, dtype: torch.dtype, device,
                    agree_group: dist.ProcessGroup | None = None) -> None:
        """Allocate the static path's buffers once, for steps of at most `max_tokens` tokens per rank."""
        self.buffers = StaticBuffers.allocate(max_tokens, top_k, self.placement.per_rank, self.placement.num_ranks,
                                              hidden, dtype, device)
        self.agree_group = agree_group
        self.static_replicas = tuple(t.to(device) for t in replica_table(self.placement))

    @property
    def static(self) -> bool:
        """Whether this forward's MoE layers take the static path."""
        return self.step_buffers is not None

    @property
    def _agree_on(self) -> dist.ProcessGroup | None:
        return self.agree_group if self.agree_group is not None else self.group

    def agree_step(self, tokens: int, captures: list[bool]) -> StepPath:
        """Every rank, once per engine step before its forwards (outside any graph; needs `buffers`): the path of
        the step's forwards, the tokens its static buffers are sized for, and whether some rank captures a decode
        graph in it (`captures`: this rank's need per bucket of `buffers.buckets`; ep_dispatch.agree_step)."""
        return agree_step(self.buffers, tokens, captures, self._agree_on)

    @contextmanager
    def pin(self, path: StepPath):
        """The step's forwards take `path` (agreed by agree_step) without agreeing again."""
        self.pinned = path
        try:
            yield
        finally:
            self.pinned = None

    def begin_forward(self, tokens: int) -> bool:
        """Every rank, once per model forward (backbone step or draft pass), before its first MoE layer, with its
        own token count: the ranks agree whether this forward's MoE layers take the static path and the tokens its
        buffers are sized for (the largest rank's, rounded up to a bucket); under `pin`, the pinned path (no
        collective)."""
        if self.pinned is not None:
            sized = self.pinned.tokens if self.pinned.static else 0
            if self.pinned.static and tokens > sized:
                raise ValueError(f"a forward of {tokens} tokens under a pinned static path sized for {sized} per "
                                 "rank: agree_step was given fewer tokens")
        else:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("an expert-parallel forward under CUDA-graph capture needs its path pinned first "
                                   "(ExpertParallel.agree_step + pin): a replay runs no agreement")
            sized = agree_static(self.buffers, tokens, self._agree_on)
        self.step_buffers = self.buffers.at(sized) if sized else None
        return self.static

    def for_layer(self, layer: int | None):
        """(placement, (replicas, copies) or None, load row or None) for MoE layer `layer`."""
        if self.layer_placements is None or layer is None:
            return self.placement, self.static_replicas, None
        return self.layer_placements[layer], (self.replicas[layer], self.copies[layer]), self.load[layer]


def local_experts(experts: Experts, placement: ExpertPlacement, rank: int) -> Experts:
    """The weights `rank` holds, one per physical slot in slot order (a replicated expert appears once per copy),
    taken from the full set of logical experts (dense tuples or PackedExperts, which stay as stored)."""
    ids = list(placement.local_logical(rank))
    if isinstance(experts, PackedExperts):
        sel = torch.tensor(ids, dtype=torch.long, device=experts.w13.device)
        return PackedExperts(experts.fmt, experts.w13[sel], experts.s13[sel], experts.w2[sel], experts.s2[sel])
    return [experts[e] for e in ids]


def replica_table(placement: ExpertPlacement, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([E, width] physical slots of each logical expert, ascending, padded with its first; [E] copies), int64 on
    the CPU. `width` (default: the most copies any expert has) lets EPLB keep one fixed-size table per layer."""
    reps = placement.replicas()
    width = max(len(r) for r in reps) if width is None else width
    if any(len(r) > width for r in reps):
        raise ValueError(f"an expert has {max(len(r) for r in reps)} copies; the table holds {width}")
    table = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.long)
    return table, torch.tensor([len(r) for r in reps], dtype=torch.long)


def choose_copies(idx: torch.Tensor, placement: ExpertPlacement, src_rank: int,
                  replicas: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[T, k] logical ids -> [T, k] physical slots: copy (t + src_rank) % copies(e) of expert e. `replicas`:
    `replica_table(placement)` already on idx's device (EPLB keeps it there), else built here."""
    table, count = replicas if replicas is not None else (t.to(idx.device) for t in replica_table(placement))
    if table.shape[1] == 1:  # one copy of every expert (no redundant slots): a lookup
        return table[:, 0][idx]
    t = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1) + src_rank
    return table[idx, t % count[idx]]


def ep_moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    experts: Experts,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | PackedExperts | None,
    swiglu_limit: float,
    placement: ExpertPlacement,
    group: dist.ProcessGroup | None = None,
    load: torch.Tensor | None = None,
    replicas: tuple[torch.Tensor, torch.Tensor] | None = None,
    experts_op=None,
    buffers: StaticBuffers | None = None,
) -> torch.Tensor:
    """The expert-parallel twin of `moe_experts`: x [T, D] this rank's tokens, weights [T, k] fp32 and idx [T, k]
    logical expert ids from the router, `experts` this rank's physical slots (`local_experts`), `shared` the
    shared expert (every rank holds it). Returns [T, D] in x's dtype, bitwise equal on the CPU to `moe_experts`
    over the same tokens with all logical experts. Every rank of `group` must call it at each MoE layer, with
    T = 0 when it has no tokens, and every rank with `buffers` of one size or every rank without. `load`
    ([per_rank] int64, optional) gets += the rows each local slot computed: the per-physical-expert counts EPLB
    measures (added on the device: no host read). `replicas`: the placement's `replica_table` on x's device
    (EPLB's prebuilt table), else built per call. `experts_op`: the registered moe_experts op (default: the torch
    reference). `buffers`: the static path (ep_dispatch.StaticBuffers, or its views for the agreed tokens: `at`; T
    must fit them), else the variable-size path."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if placement.num_ranks != world:
        raise ValueError(f"placement is for {placement.num_ranks} ranks; the group has {world}")
    n_local = experts.n_experts if isinstance(experts, PackedExperts) else len(experts)
    if n_local != placement.per_rank:
        raise ValueError(f"rank {me} holds {n_local} experts; the placement gives it {placement.per_rank}")
    tokens, k = idx.shape
    if buffers is not None and not buffers.fits(tokens):
        raise ValueError(f"{tokens} tokens on the static path, whose buffers hold {buffers.max_tokens} per rank: "
                         "the ranks must agree on the path first (ExpertParallel.begin_forward)")
    if tokens and k > 1 and not x.is_cuda:
        _check_distinct(idx)
    op = experts_op or torch_moe_experts
    hidden = x.shape[-1]
    # the shared expert over this rank's tokens first: on CUDA on a side stream, overlapping the dispatch
    side, shared_out = None, None
    if shared is not None and tokens:
        shared_out, side = _shared(op, x, experts, shared, swiglu_limit)

    # every (token, choice) routed to a physical slot, in (token, choice) order
    phys = choose_copies(idx, placement, me, replicas).reshape(-1)
    dest = phys // placement.per_rank
    meta = _pack(phys % placement.per_rank, weights.reshape(-1))
    if buffers is not None:
        row = send_rows(dest, world, buffers.capacity)
        recv_x, recv_meta = dispatch_static(buffers, x, k, meta, row, group)
        with no_host_reads():  # the kernels a graph of this step launches, also when not capturing
            out = _compute(op, recv_x, recv_meta, experts, swiglu_limit, load)
        contrib = combine_static(buffers, out, row, group)
    else:
        token = torch.arange(tokens, device=x.device).repeat_interleave(k)
        contrib = _variable(op, x, token, meta, dest, world, experts, swiglu_limit, load, group)
    contrib = contrib.view(tokens, k, hidden)

    # sum each token's experts in ascending logical id from fp32 zeros (the single-process op's order), then the
    # shared expert; one gather puts a token's k rows in that order (few kernels: this runs every layer)
    ranked = contrib.gather(1, idx.argsort(dim=1)[:, :, None].expand(-1, -1, hidden)).float()
    y = ranked[:, 0] + 0.0  # = 0 + the first, as from zeros (-0 becomes +0 either way)
    for j in range(1, k):
        y += ranked[:, j]
    if shared_out is not None:
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        y += shared_out.float()
    return y.to(x.dtype)


def _check_distinct(idx: torch.Tensor) -> None:
    """On the CPU only (it reads the ids on the host): a token's experts are distinct, as the buffers assume."""
    if (idx.sort(dim=1).values.diff(dim=1) == 0).any():
        raise ValueError("a token chose the same expert twice")


_SIDE: dict = {}


def _shared(op, x: torch.Tensor, experts: Experts, shared, limit: float):
    """The shared expert's output over x, [T, D] in x's dtype, through the op's own shared pass (every token's
    routed choice -1, "no expert"): the tiles and rounding of the single-process op's shared expert, so the sum
    stays bitwise the op's where the op is batch-invariant. On CUDA it runs on a side stream (returned; the caller
    waits for it before reading), concurrently with the dispatch and the routed experts, as `single`'s op runs its
    shared expert beside the routed pass."""
    def run():
        none = torch.full((x.shape[0], 1), -1, dtype=torch.int64, device=x.device)
        zero = torch.zeros(x.shape[0], 1, dtype=torch.float32, device=x.device)
        return op(x, zero, none, experts, shared, limit)

    if not x.is_cuda:
        return run(), None
    main = torch.cuda.current_stream(x.device)
    side = _SIDE.get(x.device)
    if side is None:
        side = _SIDE[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):  # every tensor of the call allocated on the side stream: freed into its pool
        out = run()
    # no record_stream: those blocks are reused only by the side stream's next call, which waits for the main
    # stream first (side.wait_stream above), i.e. after main has read `out`; x outlives the caller's wait
    return out, side


def _compute(op, rows: torch.Tensor, meta: torch.Tensor, experts: Experts, limit: float,
             load: torch.Tensor | None) -> torch.Tensor:
    """The received rows through this rank's experts: one expert per row (its local slot; an unused row of the
    static buffers carries UNUSED_META: slot -1, which the op skips, weight 0), each scaled by its routing weight.
    Returns [R, D] in rows' dtype."""
    slot, w = _unpack(meta)
    if load is not None:
        # index_add_ rather than bincount: bincount sizes its output from the ids' max, a host read on CUDA
        load.index_add_(0, slot.clamp(min=0), (meta >= 0).to(load.dtype))
    if rows.shape[0] == 0:
        return rows.new_empty(rows.shape)
    return op(rows, w[:, None], slot[:, None], experts, None, limit)


def _variable(op, x, token, meta, dest, world, experts, limit, load, group) -> torch.Tensor:
    """The variable-size path: rows sent in order of destination rank (stable: token, choice) after the counts
    are exchanged and read on the host. Returns each row's output in (token, choice) order."""
    order = torch.argsort(dest, stable=True)
    send_counts = torch.zeros(world, dtype=torch.int64, device=x.device)
    send_counts.index_add_(0, dest, torch.ones_like(dest))
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
    recv_x = x.new_empty(sum(recv_sizes), x.shape[-1])
    dist.all_to_all_single(recv_x, x[token[order]].contiguous(), recv_sizes, send_sizes, group=group)
    recv_meta = torch.empty(sum(recv_sizes), dtype=torch.int64, device=x.device)
    dist.all_to_all_single(recv_meta, meta[order].contiguous(), recv_sizes, send_sizes, group=group)
    out = _compute(op, recv_x, recv_meta, experts, limit, load)
    back = x.new_empty(len(order), x.shape[-1])
    dist.all_to_all_single(back, out.contiguous(), send_sizes, recv_sizes, group=group)
    contrib = torch.empty_like(back)
    contrib[order] = back
    return contrib


def _pack(slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """slot in the high 32 bits, the fp32 weight's bit pattern in the low 32 (exact round trip): one int32 pair per
    row, low word first (little-endian, as every device torch runs on), viewed as int64."""
    words = torch.stack([weight.float().contiguous().view(torch.int32), slot.to(torch.int32)], dim=-1)
    return words.view(torch.int64).squeeze(-1)


def _unpack(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot int64, weight fp32) of contiguous int64 metadata; the weight is a strided view of its low words."""
    return meta >> 32, meta.view(torch.int32).view(-1, 2)[:, 0].view(torch.float32)
