"""The grouped expert GEMM's routing table built with torch ops, for batches beyond moe_prep_kernel's one block
(moe.PREP_KERNEL_ASSIGNMENTS: its chunks of one assignment per thread run one after another, four barriers each;
it beats these sorts through 1,024 tokens as measured, and is used up to the 2,048 tokens where the FP4 prefill
path takes over; these sorts serve larger streaming calls: FP8 experts or the batch-invariant mode). Same table,
entry for entry: assignments sorted by expert with tokens ascending inside one, the distinct experts in id order as
slots, unused slots (-1, 0, 0), assignments to no expert (-1) left out. No host sync, so a captured decode step may
build it too."""

from __future__ import annotations

import torch


def routing_table_torch(idx: torch.Tensor, weights: torch.Tensor, n_experts: int):
    """(rows, aw, slot_expert, slot_start, slot_count) for router output idx/weights [T, k] (moe_prep's contract;
    rows/aw past the counted assignments are never read)."""
    T_, k = idx.shape
    E, dev = n_experts, idx.device
    flat = idx.reshape(-1)
    key = torch.where(flat < 0, torch.full_like(flat, E), flat)  # no expert sorts last
    order = torch.argsort(key, stable=True)
    rows = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    aw = weights.reshape(-1).float()[order]
    counts = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    counts = counts[:E]
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    n_slots = min(E, T_ * k)
    # the experts with assignments first, in id order (a stable sort of "is empty")
    first = torch.argsort((counts == 0).to(torch.int32), stable=True)[:n_slots]
    present = counts[first] > 0
    zero = torch.zeros((), dtype=torch.int32, device=dev)
    slot_expert = torch.where(present, first.to(torch.int32), zero - 1)
    slot_start = torch.where(present, starts[first], zero)
    slot_count = torch.where(present, counts[first], zero)
    return rows, aw, slot_expert, slot_start, slot_count
