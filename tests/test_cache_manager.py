"""CacheManager specification: sizing from the model's bytes, block-granular growth, exact frees."""

import random

import pytest

from deepinfer.engine.cache_manager import CacheManager


def test_capacity_comes_from_the_budget_and_the_models_bytes():
    # 100 B/token, 16-token blocks = 1600 B/block; 3000 B fixed state = 2 blocks; 160_000 B = 100 blocks.
    cm = CacheManager(memory_budget=160_000, bytes_per_token=100, fixed_bytes=3000, block_size=16)
    assert (cm.block_bytes, cm.fixed_blocks, cm.num_blocks) == (1600, 2, 100)
    assert cm.capacity_tokens == 98 * 16
    assert "capacity 1568 tokens" in cm.describe()


def test_a_sequence_grows_one_block_at_a_time_and_frees_everything():
    cm = CacheManager(160_000, 100, 3000, 16)
    cm.reserve(7, 1)
    assert len(cm.blocks_of(7)) == 3  # 2 fixed + 1 for the first token
    cm.reserve(7, 16)
    assert len(cm.blocks_of(7)) == 3, "still inside the first block"
    cm.reserve(7, 17)
    assert len(cm.blocks_of(7)) == 4
    cm.reserve(7, 5)
    assert len(cm.blocks_of(7)) == 4, "a reservation never shrinks"
    cm.free(7)
    cm.free(7)
    assert cm.num_free_blocks == cm.num_blocks and not cm.holds(7)


def test_admission_is_refused_exactly_when_the_free_blocks_run_out():
    cm = CacheManager(10 * 64, bytes_per_token=4, fixed_bytes=64, block_size=16)  # 10 blocks, 1 fixed
    cm.reserve(1, 16 * 5)  # 6 blocks
    assert cm.can_hold(2, 16 * 3)  # 4 blocks: exactly what is left
    assert not cm.can_hold(2, 16 * 3 + 1)
    with pytest.raises(MemoryError):
        cm.reserve(2, 16 * 4)
    assert cm.num_free_blocks == 4, "a refused reservation takes nothing"


def test_a_budget_below_one_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        CacheManager(memory_budget=1000, bytes_per_token=100, fixed_bytes=5000, block_size=4)


def test_random_reserve_and_free_never_hand_out_a_block_twice():
    rng = random.Random(3)
    cm = CacheManager(200 * 32, bytes_per_token=2, fixed_bytes=100, block_size=16)
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
        for r, n in sizes.items():
            assert cm.reserved_tokens(r) >= n
