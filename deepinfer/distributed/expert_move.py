"""Moving routed-expert weights between ranks when EPLB re-places a MoE layer (issue 13 item 4).

Each rank holds only its own physical slots' weights, so a rank that newly owns an expert must receive it from a
rank that holds it under the current placement. The plan (`plan_moves`) is a pure function of the old and new
placements, computed identically on every rank, so both ends of every transfer agree without exchanging it:
  - a slot whose expert does not change is left alone;
  - an expert this rank already holds in another slot is copied locally;
  - an expert this rank does not hold is received once (also when it fills several of its slots) from one of its
    current holders, the receivers of an expert spread round-robin over its holders.

Collective: point-to-point `isend`/`irecv` issued together through `torch.distributed.batch_isend_irecv`, one
batch per layer. Why point-to-point: a re-placement moves a few experts between a few pairs of ranks (mostly none:
most slots keep their expert), each from exactly one holder to exactly the ranks that need it; the sends read the
weight slots in place (no packing copy) and each receiver needs room for only the experts it gets. An
`all_to_all_single` would need every rank to pack its outgoing experts into one buffer and every rank to take part
even with nothing to move; a broadcast per expert would be one collective per moved expert. NCCL runs the batch as
one grouped send/recv; gloo matches the messages by tag (expert id and tensor, unique within a layer's batch).
DeepInfer does the same (eplb/shuffle.py, batched P2P; its single-node variant reads peers through symmetric
memory instead).

Everything travels as raw bytes (`uint8` views of the slot tensors): FP4/FP8 experts as stored, dense experts bit
for bit, on any backend whatever the dtype.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.kernels.packed_experts import PackedExperts

from .placement import ExpertPlacement


@dataclass(frozen=True)
class LayerMoves:
    """What one rank does to re-place one layer's experts."""

    sends: tuple[tuple[int, int, int], ...]  # (destination rank, expert, this rank's current slot holding it)
    recvs: tuple[tuple[int, int, int], ...]  # (source rank, expert, staging row)
    copies: tuple[tuple[int, int], ...]  # (this rank's current slot, staging row): an expert it already holds
    fills: tuple[tuple[int, int], ...]  # (new slot, staging row)

    @property
    def rows(self) -> int:
        return len(self.recvs) + len(self.copies)


def _holders(placement: ExpertPlacement) -> dict[int, list[int]]:
    """expert -> ranks holding it, ascending."""
    out: dict[int, list[int]] = {}
    for r in range(placement.num_ranks):
        for e in sorted(set(placement.local_logical(r))):
            out.setdefault(e, []).append(r)
    return out


def _sources(old: ExpertPlacement, new: ExpertPlacement) -> dict[tuple[int, int], int]:
    """(expert, receiving rank) -> sending rank, for every expert a rank gets and does not hold now."""
    held = _holders(old)
    out = {}
    for e, wanted in sorted(_holders(new).items()):
        receivers = [r for r in wanted if r not in held[e]]
        for j, r in enumerate(receivers):
            out[(e, r)] = held[e][j % len(held[e])]
    return out


def transfers(old: ExpertPlacement, new: ExpertPlacement) -> int:
    """Experts received across ranks (one per (expert, receiving rank)) to go from `old` to `new`."""
    return len(_sources(old, new))


def align(old: ExpertPlacement, new: ExpertPlacement) -> ExpertPlacement:
    """`new` with its ranks relabelled and each rank's slots reordered to keep as many experts where they are now:
    the balance does not depend on which rank takes which group of experts nor on the slot order inside a rank
    (copies are identical, the dispatch is exact whichever copy a token reaches), the bytes moved do. Which rank
    takes which group: the most experts already held (then the most slots already right), by the better of a
    greedy and the identity labelling, improved by swapping pairs of ranks until no swap helps (never worse than
    `new` as given). Inside a rank, a slot keeps its expert when the group still wants it."""
    if (old.num_logical, old.num_ranks, old.num_physical) != (new.num_logical, new.num_ranks, new.num_physical):
        raise ValueError("old and new placements differ in experts, ranks or slots")
    olds, news = old.per_rank_lists(), new.per_rank_lists()
    ranks = range(old.num_ranks)
    gain = [[len(set(news[g]) & set(olds[r])) * (old.num_physical + 1) + sum((Counter(news[g]) & Counter(olds[r]))
             .values()) for r in ranks] for g in ranks]  # [group][rank]
    greedy: dict[int, int] = {}  # rank -> group
    for g, r in sorted(((g, r) for g in ranks for r in ranks), key=lambda gr: (-gain[gr[0]][gr[1]], gr)):
        if g not in greedy.values() and r not in greedy:
            greedy[r] = g
    group_of = max([list(ranks), [greedy[r] for r in ranks]], key=lambda a: sum(gain[a[r]][r] for r in ranks))
    improved = True
    while improved:
        improved = False
        for r in ranks:
            for q in range(r + 1, old.num_ranks):
                a, b = group_of[r], group_of[q]
                if gain[b][r] + gain[a][q] > gain[a][r] + gain[b][q]:
                    group_of[r], group_of[q] = b, a
                    improved = True
    out = []
    for r in ranks:
        want = Counter(news[group_of[r]])
        slots: list[int | None] = []
        for e in olds[r]:
            keep = want[e] > 0
            slots.append(e if keep else None)
            want[e] -= keep
        rest = []
        for e in news[group_of[r]]:
            if want[e] > 0:
                rest.append(e)
                want[e] -= 1
        it = iter(rest)
        out.append([e if e is not None else next(it) for e in slots])
    return ExpertPlacement.from_ranks(out, old.num_logical)


def plan_moves(old: ExpertPlacement, new: ExpertPlacement, rank: int) -> LayerMoves:
    """This rank's part of going from `old` to `new` (the same plan on every rank)."""
    if (old.num_logical, old.num_ranks, old.num_physical) != (new.num_logical, new.num_ranks, new.num_physical):
        raise ValueError("old and new placements differ in experts, ranks or slots")
    mine, want = list(old.local_logical(rank)), list(new.local_logical(rank))
    src = _sources(old, new)
    sends = tuple(sorted((r, e, mine.index(e)) for (e, r), s in src.items() if s == rank))
    recvs, copies, fills, row_of = [], [], [], {}
    for j, e in enumerate(want):
        if mine[j] == e:
            continue
        if e not in row_of:
            row_of[e] = len(recvs) + len(copies)
            if e in mine:
                copies.append((mine.index(e), row_of[e]))
            else:
                recvs.append((src[(e, rank)], e, row_of[e]))
        fills.append((j, row_of[e]))
    return LayerMoves(sends, tuple(sorted(recvs)), tuple(copies), tuple(fills))


def slot_tensors(experts, j: int) -> list[torch.Tensor]:
    """The tensors of slot j: PackedExperts rows (w13, s13, w2, s2) or a dense expert's (w1, w2, w3)."""
    if isinstance(experts, PackedExperts):
        return [experts.w13[j], experts.s13[j], experts.w2[j], experts.s2[j]]
    return list(experts[j])


def own_slots(experts):
    """Give every slot its own storage, so a slot can be overwritten without changing another: the loader hands a
    replicated dense expert to all its slots as the same tensors (PackedExperts rows are separate already).
    Returns the experts (a dense list is updated in place)."""
    if isinstance(experts, PackedExperts):
        return experts
    seen: set[int] = set()
    for j, slot in enumerate(experts):
        ptrs = {t.untyped_storage().data_ptr() for t in slot}
        if ptrs & seen:
            experts[j] = tuple(t.clone() for t in slot)
            ptrs = {t.untyped_storage().data_ptr() for t in experts[j]}
        seen |= ptrs
    return experts


def slot_bytes(experts) -> int:
    return sum(t.numel() * t.element_size() for t in slot_tensors(experts, 0))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def move_experts(experts, moves: LayerMoves, group: dist.ProcessGroup | None = None) -> int:
    """Apply one layer's moves to this rank's slots in place; returns the bytes this rank received. The staging
    rows take every incoming expert before any slot is overwritten: a slot may be sent or copied from and refilled
    in the same re-placement. Every rank must call this for the same layers in the same order."""
    if not moves.sends and not moves.rows:
        return 0
    n = len(slot_tensors(experts, 0))
    staging = [torch.empty((moves.rows, *t.shape), dtype=t.dtype, device=t.device) for t in slot_tensors(experts, 0)]
    for slot, row in moves.copies:
        for buf, t in zip(staging, slot_tensors(experts, slot)):
            buf[row].copy_(t)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    ops = []
    for dst, e, slot in moves.sends:  # ascending (peer, expert) on both ends: NCCL pairs each peer's messages in order
        ops += [dist.P2POp(dist.isend, _bytes(t), peer(dst), group, tag=e * n + k)
                for k, t in enumerate(slot_tensors(experts, slot))]
    for src, e, row in moves.recvs:
        ops += [dist.P2POp(dist.irecv, buf[row].reshape(-1).view(torch.uint8), peer(src), group, tag=e * n + k)
                for k, buf in enumerate(staging)]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for slot, row in moves.fills:
        for buf, t in zip(staging, slot_tensors(experts, slot)):
            t.copy_(buf[row])
    return len(moves.recvs) * slot_bytes(experts)
