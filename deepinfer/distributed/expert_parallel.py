"""Expert-parallel MoE over torch.distributed: each rank holds its own tokens (attention data parallel) and the
routed experts of its physical slots (ExpertPlacement); a token's hidden state travels to the ranks that own the
experts it chose, is computed there, and comes back to be summed on its own rank.

Collective: `torch.distributed.all_to_all_single`, four calls per MoE layer: the row counts, the hidden rows, their
(local slot, routing weight) packed in one int64 per row, and the combine. Why all-to-all: every rank sends a different,
data-dependent number of rows to every other rank and receives rows from all of them in one step; the variable-split
`all_to_all_single` is exactly that exchange (NCCL: grouped send/recv; gloo: alltoallv), one call for all peers,
where an all-gather would ship every token to every rank. Its splits must be known on both sides, and a receiver
cannot know how many rows are coming, so the per-peer row counts are exchanged first (a [world] all-to-all). Every
rank calls every collective, also with zero tokens (zero counts): the collectives need all ranks, so an idle rank
still takes part (DeepInfer's idle ranks run dummy steps for the same reason).

Exactness: the sum over a token's experts runs on the token's own rank in ascending logical expert id, starting
from fp32 zeros, then the shared expert, then the cast: the accumulation order of the single-process op
(deepinfer.kernels.torch.moe.moe_experts, CPU path: `for e in torch.unique(idx)`). Each expert's output goes
through the same `swiglu_expert`, which is row-invariant on the CPU (kernels/torch/linear.py pads rows to a fixed
tile; elementwise.py keeps every element on the SIMD path), so a row's output does not depend on which other rows
share the call: the result is bitwise equal to the single-process op. On CUDA the GEMMs are not row-invariant and
only agreement within bf16 noise holds (issue 13 item 6).

Replica choice: a (token, expert) pair with c copies goes to copy `(token index + source rank) % c`, a fixed rule
that spreads a hot expert's tokens over its copies. DeepInfer picks the copy inside its compiled gate kernel
(`to_physical_map` / `logical_count` arguments, not in the sdist's Python), so its exact rule is not followed.

Not the fast path: the host reads the counts (one device sync per layer) and the experts run as a loop; DeepInfer
dispatches and combines through DeepEP's EPBuffer (parallel_utils/userbuffer.py, optionally FP8 dispatch) into
grouped GEMMs. This is the reference a fast path must equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.kernels.packed_experts import PackedExperts
from deepinfer.kernels.torch.moe import swiglu_expert

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

    def for_layer(self, layer: int | None):
        """(placement, (replicas, copies) or None, load row or None) for MoE layer `layer`."""
        if self.layer_placements is None or layer is None:
            return self.placement, None, None
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
) -> torch.Tensor:
    """The expert-parallel twin of `moe_experts`: x [T, D] this rank's tokens, weights [T, k] fp32 and idx [T, k]
    logical expert ids from the router, `experts` this rank's physical slots (`local_experts`), `shared` the
    shared expert (every rank holds it). Returns [T, D] in x's dtype, bitwise equal on the CPU to `moe_experts`
    over the same tokens with all logical experts. Every rank of `group` must call it at each MoE layer, with
    T = 0 when it has no tokens. `load` ([per_rank] int64, optional) gets += the rows each local slot computed:
    the per-physical-expert counts EPLB measures (added on the device: no host read). `replicas`: the placement's
    `replica_table` on x's device (EPLB's prebuilt table), else built per call."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if placement.num_ranks != world:
        raise ValueError(f"placement is for {placement.num_ranks} ranks; the group has {world}")
    n_local = experts.n_experts if isinstance(experts, PackedExperts) else len(experts)
    if n_local != placement.per_rank:
        raise ValueError(f"rank {me} holds {n_local} experts; the placement gives it {placement.per_rank}")
    tokens, k = idx.shape
    if tokens and k > 1 and (idx.sort(dim=1).values.diff(dim=1) == 0).any():
        raise ValueError("a token chose the same expert twice")
    dev, hidden = x.device, x.shape[-1]

    # route every (token, choice) to a physical slot; send in order of destination rank (stable: token, choice)
    phys = choose_copies(idx, placement, me, replicas).reshape(-1)
    dest = phys // placement.per_rank
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()

    # dispatch: hidden rows, and (local slot, routing weight) packed in one int64 per row
    recv_x = x.new_empty(sum(recv_sizes), hidden)
    dist.all_to_all_single(recv_x, x[order // k].contiguous(), recv_sizes, send_sizes, group=group)
    meta = _pack(phys[order] % placement.per_rank, weights.reshape(-1)[order])
    recv_meta = torch.empty(sum(recv_sizes), dtype=torch.int64, device=dev)
    dist.all_to_all_single(recv_meta, meta, recv_sizes, send_sizes, group=group)
    slot, w = _unpack(recv_meta)

    # this rank's experts, each over the rows sent to it (from every source rank)
    out = x.new_empty(recv_x.shape)
    for j in torch.unique(slot).tolist():
        rows = torch.where(slot == j)[0]
        w1, w2, w3 = _dense(experts, j, x.dtype)
        out[rows] = swiglu_expert(recv_x[rows], w1, w2, w3, swiglu_limit, w[rows, None])
    if load is not None:
        # index_add_ rather than bincount: bincount sizes its output from the ids' max, a host read on CUDA
        load.index_add_(0, slot, load.new_ones(()).expand(slot.numel()))

    # combine: the outputs return to their token's rank in the order they were sent
    back = x.new_empty(len(order), hidden)
    dist.all_to_all_single(back, out, send_sizes, recv_sizes, group=group)
    contrib = torch.empty_like(back)
    contrib[order] = back
    contrib = contrib.view(tokens, k, hidden)

    # sum each token's experts in ascending logical id (the single-process op's order), then the shared expert
    by_id = idx.argsort(dim=1)
    y = torch.zeros(x.shape, dtype=torch.float32, device=dev)
    for j in range(k):
        pick = by_id[:, j, None, None].expand(-1, 1, hidden)
        y += contrib.gather(1, pick).squeeze(1).float()
    if shared is not None:
        w1, w2, w3 = shared.dense(0, x.dtype) if isinstance(shared, PackedExperts) else shared
        y += swiglu_expert(x, w1, w2, w3, swiglu_limit).float()
    return y.to(x.dtype)


def _dense(experts, e: int, dtype: torch.dtype):
    return experts.dense(e, dtype) if isinstance(experts, PackedExperts) else experts[e]


def _pack(slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """slot in the high 32 bits, the fp32 weight's bit pattern in the low 32 (exact round trip)."""
    bits = weight.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (slot.to(torch.int64) << 32) | bits


def _unpack(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low = meta & 0xFFFFFFFF
    bits = torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32)
    return meta >> 32, bits.view(torch.float32)
