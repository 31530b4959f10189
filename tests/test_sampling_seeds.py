"""Counter-based randomness and the inverse-CDF draw: uniforms keyed by (seed, position, kind) only, integer
weights with exact sums, and draws that invert the integer CDF."""

import torch

from deepinfer.sampling.fixed_point import draw_from_weights, fixed_point_scale, fixed_point_weights
from deepinfer.sampling.seeds import DrawKind, child_seed, mix64, request_seed, stream_key, uniform

MASK64 = (1 << 64) - 1


def test_mix64_matches_published_splitmix64_outputs():
    # splitmix64 started at state 0 outputs mix(golden), mix(2 * golden), ... (the reference C implementation)
    golden = 0x9E3779B97F4A7C15
    assert mix64(golden) == 0xE220A8397B1DCDAF
    assert mix64((2 * golden) & MASK64) == 0x6E789E6AA1B965F4
    assert mix64((3 * golden) & MASK64) == 0x06C45D188009454F


def test_uniforms_lie_in_the_unit_interval_with_uniform_moments():
    u = torch.tensor([uniform(123, 0, DrawKind.TOKEN, i) for i in range(100_000)], dtype=torch.float64)
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002


def test_streams_differ_by_seed_position_and_kind():
    keys = {stream_key(seed, pos, kind) for seed in (0, 1, MASK64) for pos in range(50) for kind in DrawKind}
    assert len(keys) == 3 * 50 * len(DrawKind)
    assert uniform(5, 3, DrawKind.TOKEN) == uniform(5, 3, DrawKind.TOKEN)
    assert uniform(5, 3, DrawKind.TOKEN) != uniform(5, 3, DrawKind.DRAFT)


def test_child_zero_keeps_the_parent_seed_and_children_are_distinct():
    assert child_seed(42, 0) == 42
    children = [child_seed(42, i) for i in range(100)]
    assert len(set(children)) == 100
    assert all(0 <= c <= MASK64 for c in children)
    assert child_seed(42, 1) != child_seed(43, 1)


def test_request_seed_keeps_a_given_seed_and_draws_fresh_ones_otherwise():
    assert request_seed(7) == 7
    fresh = {request_seed(None) for _ in range(20)}
    assert len(fresh) == 20 and all(0 <= s <= MASK64 for s in fresh)


def test_fixed_point_weights_are_exp_relative_to_the_row_max():
    logits = torch.tensor([[0.0, -1.0, float("-inf"), -100.0], [float("-inf")] * 4])
    w = fixed_point_weights(logits)
    scale = fixed_point_scale(4)
    assert w[0, 0].item() == scale
    assert abs(w[0, 1].item() / scale - 0.36787944117144233) < 1e-12
    assert w[0, 2].item() == 0 and w[0, 3].item() == 0  # e**-100 is below the fixed-point resolution
    assert w[1].tolist() == [0, 0, 0, 0]  # an all -inf row gives zeros, not NaN
    assert w.sum(dim=-1).max().item() < 2**62


def test_the_draw_inverts_the_integer_cdf():
    weights = torch.tensor([[0, 3, 0, 1]] * 6)
    # CDF 0,3,3,4: [0, 0.75) -> token 1, [0.75, 1) -> token 3; the zero-weight tokens never come out
    assert draw_from_weights(weights, [0.0, 0.5, 0.7499, 0.75, 0.9, 1.0 - 2**-53]) == [1, 1, 1, 3, 3, 3]
