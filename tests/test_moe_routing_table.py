"""The grouped expert GEMM's routing table built with torch ops (kernels/tilelang/moe_table.py, used from 2048
assignments) is moe_prep_kernel's table entry for entry: assignments grouped by expert, tokens ascending inside
one, distinct experts in id order as slots, unused slots (-1, 0, 0), no-expert (-1) assignments left out."""

import pytest
import torch

from deepinfer.kernels.tilelang.moe_table import routing_table_torch


def reference_table(idx, weights, E):
    """moe_prep's contract, written out one expert at a time."""
    T_, k = idx.shape
    rows, aw, slots = [], [], []
    for e in range(E):
        placed = [(t, j) for t in range(T_) for j in range(k) if int(idx[t, j]) == e]
        if placed:
            slots.append((e, len(rows), len(placed)))
        rows += [t for t, _ in placed]
        aw += [float(weights[t, j]) for t, j in placed]
    n_slots = min(E, T_ * k)
    slots += [(-1, 0, 0)] * (n_slots - len(slots))
    return rows, aw, slots


@pytest.mark.parametrize("T_,k,E,holes", [(1, 6, 16, 0), (5, 2, 4, 0), (37, 6, 16, 5), (3, 2, 64, 1),
                                          (400, 6, 384, 20)])
def test_the_torch_table_is_the_kernel_contract(T_, k, E, holes):
    g = torch.Generator().manual_seed(T_ * 31 + E)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T_)])
    if holes:  # assignments to no expert (expert parallelism's empty receive rows)
        flat = idx.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:holes]] = -1
    weights = torch.rand(T_, k, generator=g)
    rows, aw, s_exp, s_start, s_cnt = routing_table_torch(idx, weights, E)
    want_rows, want_aw, want_slots = reference_table(idx, weights, E)
    n = len(want_rows)
    assert rows[:n].tolist() == want_rows and aw[:n].tolist() == want_aw
    assert list(zip(s_exp.tolist(), s_start.tolist(), s_cnt.tolist())) == want_slots
    assert rows.dtype == s_exp.dtype == torch.int32 and aw.dtype == torch.float32
