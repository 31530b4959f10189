"""EPLB placement policy (deepinfer/distributed/eplb.py) on synthetic expert loads."""

from __future__ import annotations

import pytest
import torch

from deepinfer.distributed.eplb import imbalance, rebalance
from deepinfer.distributed.placement import ExpertPlacement


def skewed(num_experts: int = 64, seed: int = 0, window: int = 0) -> torch.Tensor:
    """Zipf-like token counts (a few very hot experts), shuffled over expert ids; [window, E] when window."""
    g = torch.Generator().manual_seed(seed)
    base = 10000.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    base = base[torch.randperm(num_experts, generator=g)]
    if not window:
        return base.round()
    noise = torch.rand(window, num_experts, generator=g, dtype=torch.float64) + 0.5
    return (base * noise).round()


def test_balanced_load_stays_balanced():
    out = rebalance(torch.full((32,), 100.0), num_ranks=4, num_redundant=0)
    assert out.imbalance_before == out.imbalance_after == 1.0
    assert sorted(e for r in out.placement.per_rank_lists() for e in r) == list(range(32))
    assert all(len(r) == 8 for r in out.placement.per_rank_lists())


def test_hot_expert_gets_replicas_on_different_ranks():
    counts = torch.full((16,), 10.0)
    counts[5] = 400.0
    out = rebalance(counts, num_ranks=4, num_redundant=4)
    assert out.copies[5] == 5 and sum(out.copies) == 20  # every redundant slot goes to the hot expert
    holders = [r for r, experts in enumerate(out.placement.per_rank_lists()) if 5 in experts]
    assert len(holders) == 4  # spread: no rank holds two of its copies while another holds none
    assert out.imbalance_after < out.imbalance_before


def test_imbalance_falls_on_skewed_load():
    counts = skewed()
    for ranks, redundant in ((4, 0), (8, 8), (8, 16)):
        out = rebalance(counts, ranks, redundant)
        assert out.imbalance_after < out.imbalance_before, (ranks, redundant)
    # without copies the hottest expert alone bounds it (its count x 8 / total = 2.34); with copies it reaches ~1
    bound = (counts.max() * 8 / counts.sum()).item()
    assert bound <= rebalance(counts, 8, 0).imbalance_after < bound * 1.1
    assert rebalance(counts, 8, 8).imbalance_after < 1.01 and rebalance(counts, 8, 16).imbalance_after < 1.01


def test_windowed_counts_and_a_current_placement():
    counts = skewed(window=20, seed=3)
    out = rebalance(counts, 8, 8)
    assert out.imbalance_after < out.imbalance_before
    # re-placing from the new placement on the same load: "before" is now that placement's imbalance
    again = rebalance(counts, 8, 8, current=out.placement)
    assert again.imbalance_before == pytest.approx(out.imbalance_after)
    assert again.placement == out.placement  # the policy depends on the counts only


def test_deterministic_and_a_permutation_of_experts():
    counts = skewed(seed=1)
    a, b = rebalance(counts, 8, 8), rebalance(counts.clone(), 8, 8)
    assert a == b
    # every logical expert placed at least once; each rank's slots full
    flat = a.placement.physical_to_logical
    assert set(flat) == set(range(64)) and len(flat) == 72
    assert [flat.count(e) for e in range(64)] == list(a.copies)


def test_imbalance_metric():
    pl = ExpertPlacement.from_ranks([[0, 1], [2, 3]], 4)
    assert imbalance(torch.tensor([3.0, 1.0, 1.0, 1.0]), pl) == pytest.approx(4 / 3)
    # a replicated expert's count splits over its copies
    rep = ExpertPlacement.from_ranks([[0, 1], [0, 2]], 3)
    assert imbalance(torch.tensor([4.0, 1.0, 1.0]), rep) == pytest.approx(1.0)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="divide"):
        rebalance(torch.ones(10), num_ranks=4, num_redundant=1)
    with pytest.raises(ValueError, match="non-negative"):
        rebalance(torch.tensor([1.0, -1.0]), num_ranks=2, num_redundant=0)
    with pytest.raises(ValueError, match="shape"):
        rebalance(torch.ones(2, 2, 2), num_ranks=2, num_redundant=0)
