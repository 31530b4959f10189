"""Counter-based randomness: the torch hash equals its uint64 reference, and streams are keyed by
(seed, position, kind) only."""

import random

import torch

from deepinfer.sampling.seeds import (
    DrawKind,
    _signed,
    child_seed,
    mix64,
    mix64_int,
    request_seed,
    stream_key_int,
    stream_keys,
    uniforms_at,
)

MASK64 = (1 << 64) - 1


def test_mix64_in_wrapping_int64_equals_the_uint64_reference():
    rng = random.Random(1)
    values = [0, 1, MASK64, 1 << 63, (1 << 63) - 1] + [rng.getrandbits(64) for _ in range(5000)]
    got = mix64(torch.tensor([_signed(v) for v in values], dtype=torch.int64)).tolist()
    assert [g & MASK64 for g in got] == [mix64_int(v) for v in values]


def test_mix64_int_matches_published_splitmix64_outputs():
    # splitmix64 with state 0: the first outputs are mix(golden), mix(2 * golden) (reference C implementation).
    golden = 0x9E3779B97F4A7C15
    assert mix64_int(golden) == 0xE220A8397B1DCDAF
    assert mix64_int((2 * golden) & MASK64) == 0x6E789E6AA1B965F4


def test_uniforms_lie_in_the_open_unit_interval_with_uniform_moments():
    keys = stream_keys([123], [0], DrawKind.TOKEN, "cpu").expand(200_000)
    u = uniforms_at(keys, torch.arange(200_000))
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002


def test_streams_differ_by_seed_position_and_kind():
    keys = {
        stream_key_int(seed, pos, kind)
        for seed in (0, 1, 2**64 - 1)
        for pos in range(50)
        for kind in DrawKind
    }
    assert len(keys) == 3 * 50 * len(DrawKind)


def test_child_zero_keeps_the_parent_seed_and_children_are_distinct():
    assert child_seed(42, 0) == 42
    children = [child_seed(42, i) for i in range(100)]
    assert len(set(children)) == 100
    assert all(0 <= c <= MASK64 for c in children)
    assert child_seed(42, 3) == child_seed(42, 3)
    assert child_seed(42, 1) != child_seed(43, 1)


def test_request_seed_keeps_a_given_seed_and_draws_fresh_ones_otherwise():
    assert request_seed(7) == 7
    fresh = {request_seed(None) for _ in range(20)}
    assert len(fresh) == 20
    assert all(0 <= s <= MASK64 for s in fresh)
