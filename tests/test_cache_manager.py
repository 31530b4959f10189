"""CacheManager specification: slots and blocks sized from the budget, real ids handed out, exact frees."""

import random
import tracemalloc

import pytest

from deepinfer.engine.cache_manager import CacheManager


def test_the_budget_pays_for_slots_first_then_blocks():
    # 3000 B per slot, 1600 B per block of 16 tokens: 8 slots take 24 000 B, the other 136 000 B are 85 blocks
    cm = CacheManager.from_budget(160_000, slot_bytes=3000, block_bytes=1600, block_size=16, max_num_seqs=8,
                                  max_model_len=4096)
    assert (cm.num_slots, cm.num_blocks) == (8, 85)
    assert cm.capacity_tokens == 85 * 16
    assert "8 slots, 85 blocks x 16 tokens" in cm.describe()


def test_blocks_are_capped_at_what_every_slot_could_fill():
    cm = CacheManager.from_budget(10**12, slot_bytes=100, block_bytes=100, block_size=16, max_num_seqs=4,
                                  max_model_len=1000)
    assert cm.num_blocks == 4 * 63, "4 sequences of at most 1000 tokens never use more than 4 x 63 blocks"


def test_a_huge_budget_costs_no_memory_at_start():
    tracemalloc.start()
    try:
        cm = CacheManager.from_budget(10**14, slot_bytes=1000, block_bytes=64, block_size=16, max_num_seqs=256,
                                      max_model_len=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cm.num_blocks == 256 * (1 << 16)
    assert peak < 64 * 1024, "bookkeeping of 16M blocks allocated up front"
    cm.reserve(1, 16 * 3)
    assert cm.blocks_of(1) == [0, 1, 2] and cm.num_used_blocks == 3


def test_a_budget_below_one_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        CacheManager.from_budget(1000, slot_bytes=5000, block_bytes=100, block_size=4, max_num_seqs=1,
                                 max_model_len=64)


def test_a_sequence_takes_a_slot_and_grows_one_block_at_a_time():
    cm = CacheManager(num_slots=2, num_blocks=100, block_size=16)
    cm.reserve(7, 1)
    assert len(cm.blocks_of(7)) == 1 and cm.slot_of(7) in (0, 1)
    assert cm.take_new_blocks(7) == tuple(cm.blocks_of(7)), "the first row hands the runner every block"
    cm.reserve(7, 16)
    assert cm.take_new_blocks(7) == (), "still inside the first block"
    cm.reserve(7, 17)
    assert len(cm.blocks_of(7)) == 2 and cm.take_new_blocks(7) == (cm.blocks_of(7)[1],)
    cm.reserve(7, 5)
    assert len(cm.blocks_of(7)) == 2, "a reservation never shrinks"
    cm.free(7)
    cm.free(7)
    assert cm.num_used_blocks == 0 and not cm.holds(7)
    cm.reserve(8, 16 * 99)
    cm.reserve(9, 1)  # every block and both slots are free again


def test_admission_needs_a_free_slot_and_the_blocks():
    cm = CacheManager(num_slots=2, num_blocks=10, block_size=16)
    cm.reserve(1, 16 * 6)  # 6 blocks
    assert cm.can_hold(2, 16 * 4)  # 4 blocks: exactly what is left
    assert not cm.can_hold(2, 16 * 4 + 1)
    with pytest.raises(MemoryError):
        cm.reserve(2, 16 * 5)
    assert cm.num_used_blocks == 6 and not cm.holds(2), "a refused reservation takes nothing"
    assert cm.can_hold(2, 16 * 4)
    cm.reserve(2, 1)
    assert not cm.can_hold(3, 1), "no slot left, however many blocks are free"


def test_random_reserve_and_free_never_hand_out_a_slot_or_block_twice():
    rng = random.Random(3)
    cm = CacheManager(num_slots=12, num_blocks=200, block_size=16)
    sizes: dict[int, int] = {}
    for _ in range(2000):
        rid = rng.randrange(20)
        if rng.random() < 0.3:
            cm.free(rid)
            sizes.pop(rid, None)
        else:
            want = sizes.get(rid, 0) + rng.randint(1, 40)
            if cm.can_hold(rid, want):
                cm.reserve(rid, want)
                sizes[rid] = want
        held = [b for r in sizes for b in cm.blocks_of(r)]
        assert len(held) == len(set(held)) == cm.num_used_blocks
        slots = [cm.slot_of(r) for r in sizes]
        assert len(slots) == len(set(slots)) and all(0 <= s < 12 for s in slots)
        for r, n in sizes.items():
            assert len(cm.blocks_of(r)) * cm.block_size >= n
