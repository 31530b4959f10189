"""Confidence-scheduled verification (DSpark varlen) specification, on synthetic confidences and cost curves.

The planner picks the step's total size that maximises expected tokens per ms on the cost curve, then gives the
draft slots to the most confident (request, position) pairs, each request's drafts as a prefix.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path

import pytest

from deepinfer.engine import spec_schedule
from deepinfer.engine.spec_schedule import (
    CostCurve,
    VarlenPlanner,
    cumulative_rates,
    load_or_profile_cost_curve,
    perf_cache_path,
    profile_cost_curve,
)

pytestmark = pytest.mark.timeout(10)

SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def curve_of(fn, sizes=SIZES) -> CostCurve:
    return CostCurve([(n, fn(n)) for n in sizes])


def plan(curve, rates, max_k=None, budget_rates=None, max_draft=5, **kw):
    planner = VarlenPlanner(curve, max_draft)
    max_k = [max_draft] * len(rates) if max_k is None else max_k
    return planner.plan(rates if budget_rates is None else budget_rates, rates, max_k, **kw)


# --- cumulative rates -------------------------------------------------------------------------------------------


def test_cumulative_rates_are_prefix_products_of_confidences():
    assert cumulative_rates([0.5, 0.5, 0.8]) == pytest.approx([0.5, 0.25, 0.2])
    assert cumulative_rates([]) == []


# --- budget from the cost curve ---------------------------------------------------------------------------------


def test_flat_curve_verifies_every_draft():
    rates = [cumulative_rates([0.9] * 5), cumulative_rates([0.3] * 5), cumulative_rates([0.6] * 3)]
    assert plan(curve_of(lambda n: 10.0), rates) == [5, 5, 3]


def test_steep_curve_verifies_no_draft():
    # every extra token costs as much as the whole step: never worth a draft that is not certain
    rates = [cumulative_rates([0.9] * 5) for _ in range(4)]
    assert plan(curve_of(lambda n: 1.0 * n), rates) == [0, 0, 0, 0]


def test_budget_stops_at_the_knee_of_the_curve():
    # flat to 16 tokens, then each doubling doubles the time: 4 requests x 5 confident drafts -> 24 tokens wanted,
    # but the step stops at 16 tokens (12 drafts) where the curve turns
    curve = CostCurve([(8, 10.0), (16, 10.0), (32, 20.0), (64, 40.0)])
    k = plan(curve, [cumulative_rates([0.95] * 5) for _ in range(4)])
    assert sum(k) + 4 == 16


def test_budget_counts_golden_tokens_and_uses_graph_sizes_as_buckets():
    # 3 requests; sizes 4 and 8 cost the same, so the planner fills bucket 8 (5 drafts) but not 16
    curve = CostCurve([(4, 5.0), (8, 5.0), (16, 50.0)])
    assert sum(plan(curve, [cumulative_rates([0.8] * 5) for _ in range(3)])) == 5


def test_sizes_past_the_curve_are_never_chosen():
    curve = CostCurve([(4, 1.0), (8, 1.0)])
    assert sum(plan(curve, [[1.0] * 5 for _ in range(4)])) == 4  # 8 tokens is the largest priced step
    assert plan(curve, [[1.0] * 5 for _ in range(9)]) == [0] * 9  # golden tokens alone are past the curve


def test_useless_slots_are_not_verified_even_when_free():
    # a free token does not improve throughput unless it may be accepted: only a strict gain moves the budget
    rates = [[0.9, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert plan(curve_of(lambda n: 10.0), rates) == [1, 0]


def test_slots_that_cannot_pass_are_not_verified_even_when_a_larger_step_measures_cheaper():
    # a measured curve need not rise (noise; a graph bucket faster than a smaller one): on the H200 a step of six
    # tokens once priced below one, and the planner verified five drafts its confidences put at 0
    dip = CostCurve([(1, 12.0), (2, 11.5), (4, 11.8), (6, 11.0)])
    assert plan(dip, [[0.0] * 5]) == [0]
    assert plan(dip, [[1.0, 1.0, 0.0, 0.0, 0.0]]) == [2]
    assert plan(dip, [[1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 5]) == [2, 0]


def test_budget_maximises_expected_tokens_per_ms_exactly():
    # brute force over every total size on a random convex-ish curve
    rng = random.Random(7)
    for _ in range(30):
        sizes = sorted(rng.sample(range(1, 40), 8))
        curve = CostCurve([(n, 3.0 + 0.2 * n + rng.random()) for n in sizes])
        rates = [cumulative_rates([rng.random() for _ in range(rng.randint(0, 5))]) for _ in range(rng.randint(1, 6))]
        k = plan(curve, rates, max_k=[len(r) for r in rates])
        slots = sorted((r for rs in rates for r in rs), reverse=True)
        best = 0.0
        for extra in range(len(slots) + 1):
            b = curve.bucket(len(rates) + extra)
            if b is not None:
                best = max(best, (len(rates) + sum(slots[:extra])) / b[1])
        b = curve.bucket(len(rates) + sum(k))
        got = (len(rates) + sum(r for rs, ki in zip(rates, k) for r in rs[:ki])) / b[1] if b else 0.0
        assert got == pytest.approx(best)


# --- allocation ---------------------------------------------------------------------------------------------------


def test_slots_go_to_the_most_confident_requests_first():
    # room for 4 drafts over 3 requests (7 tokens -> bucket 8 is free, 9+ is expensive)
    curve = CostCurve([(4, 5.0), (8, 5.0), (16, 100.0)])
    rates = [cumulative_rates([0.5] * 5), cumulative_rates([0.9] * 5), cumulative_rates([0.8] * 5)]
    # ranked: 0.9, 0.81 (req 1), 0.8 (req 2), 0.729, 0.656 (req 1), 0.64 (req 2), ..., 0.5 (req 0)
    assert plan(curve, rates) == [0, 4, 1]


def test_ties_break_by_request_index():
    curve = CostCurve([(4, 5.0), (6, 5.0), (16, 100.0)])
    # 4 identical requests, room for 2 drafts: the first two requests get one each
    assert plan(curve, [cumulative_rates([0.7] * 3) for _ in range(4)]) == [1, 1, 0, 0]
    # equal rates within and across requests: lower request index first, then position
    assert VarlenPlanner.allocate(4, [[0.7] * 3, [0.7] * 3]) == [3, 1]


def test_budget_from_older_rates_allocation_from_fresh_rates():
    # two steps back request 0 looked certain and request 1 hopeless: that sets the budget (3 drafts);
    # the fresh rates then give those 3 slots to request 1
    curve = CostCurve([(2, 5.0), (5, 5.5), (8, 100.0)])
    old = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    fresh = [[0.2, 0.1, 0.05], [0.9, 0.8, 0.7]]
    assert plan(curve, fresh, budget_rates=old, max_k=[3, 3]) == [0, 3]
    # and the other way round: old rates that promised nothing give no budget, however confident the fresh ones
    assert plan(curve, fresh, budget_rates=[[0.0] * 3, [0.0] * 3], max_k=[3, 3]) == [0, 0]


def test_a_budget_larger_than_the_fresh_rates_never_verifies_a_slot_of_rate_zero():
    # two steps back every slot looked certain (budget 5); the fresh rates pass three drafts and rule out the rest
    # (a calibrated head's 0): the fourth is not verified, however much budget is left
    curve = CostCurve([(1, 10.0), (2, 10.2), (4, 10.4), (8, 10.8)])
    fresh = [[1.0, 1.0, 1.0, 0.0, 0.0]]
    assert plan(curve, fresh, budget_rates=[[1.0] * 5], max_k=[5]) == [3]
    assert VarlenPlanner.allocate(5, [[0.9, 0.0], [0.5]]) == [1, 1]


def test_a_draft_is_verified_only_after_the_drafts_before_it():
    # rates that rise along a request (not cumulative, e.g. a caller bug) still give prefixes: the late high
    # rate is capped by the low one before it
    curve = CostCurve([(4, 5.0), (5, 5.0), (16, 100.0)])
    rates = [[0.1, 0.9, 0.9], [0.5, 0.4, 0.3]]
    assert plan(curve, rates) == [0, 3]
    for budget in range(7):
        counts = VarlenPlanner.allocate(budget, rates)
        assert sum(counts) == min(budget, 6)
        assert counts[0] <= 3 and counts[1] <= 3


def test_allocation_is_a_prefix_for_random_rates():
    rng = random.Random(3)
    for _ in range(50):
        rates = [[rng.random() for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 8))]
        budget = rng.randint(0, 40)
        counts = VarlenPlanner.allocate(budget, rates)  # asserts the prefix rule internally
        assert sum(counts) == min(budget, sum(map(len, rates)))
        assert VarlenPlanner.allocate(budget, rates) == counts  # deterministic


def test_max_k_caps_each_request():
    rates = [cumulative_rates([0.99] * 5) for _ in range(3)]
    assert plan(curve_of(lambda n: 10.0), rates, max_k=[5, 2, 0]) == [5, 2, 0]
    assert plan(curve_of(lambda n: 10.0), rates, max_k=[9, 9, 9], max_draft=3) == [3, 3, 3]  # clipped to max_draft


def test_unknown_rates_pad_with_one_if_the_request_has_drafts_else_zero():
    curve = CostCurve([(4, 5.0), (8, 5.0), (16, 100.0)])
    # first step after prefill: no confidences yet; drafts present -> treated as certain
    assert plan(curve, [[], [], []], max_k=[2, 2, 0]) == [2, 2, 0]
    # has_draft=False: padded with 0.0, never verified
    assert plan(curve, [[], []], max_k=[3, 3], has_draft=[True, False]) == [3, 0]
    # fewer rates than drafts: slot count follows the drafts the rates describe
    assert plan(curve_of(lambda n: 1.0), [[0.9, 0.8], [0.9]], max_k=[5, 5]) == [2, 1]


def test_empty_curve_verifies_every_draft_and_empty_batch_plans_nothing():
    assert VarlenPlanner(CostCurve([]), 5).plan([[0.1] * 5, []], [[0.1] * 5, []], [5, 3]) == [5, 3]
    assert VarlenPlanner(curve_of(lambda n: 1.0), 5).plan([], [], []) == []


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError):
        VarlenPlanner(curve_of(lambda n: 1.0), 5).plan([[]], [[], []], [1, 1])


# --- online refinement --------------------------------------------------------------------------------------------


def test_measured_times_above_the_curve_shrink_the_budget():
    # the profiled curve is flat (verify everything); measured steps show 1 ms per token on top of it
    curve = CostCurve([(4, 10.0), (8, 10.0), (16, 10.0), (32, 10.0)])
    planner = VarlenPlanner(curve, 5)
    rates = [cumulative_rates([0.5] * 5) for _ in range(4)]
    assert planner.plan(rates, rates, [5] * 4) == [5] * 4
    for _ in range(10):
        for g in (8, 16):
            planner.update_runtime(4, g, forward_ms=10.0 + 1.0 * g)
    assert planner.slope_ms == pytest.approx(1.0)
    assert planner.step_ms(9, 4) == pytest.approx(10.0 + 16)
    k = planner.plan(rates, rates, [5] * 4)
    # now 8 tokens (one draft each): (4 + 4·0.5) / 18 ms beats 4 / 14 (golden only) and 6.25 / 26 (bucket 16)
    assert k == [1, 1, 1, 1]


def test_slope_needs_enough_samples_per_size_and_is_never_negative():
    planner = VarlenPlanner(CostCurve([(4, 10.0), (8, 10.0)]), 5)
    for _ in range(9):
        planner.update_runtime(2, 8, forward_ms=50.0)
    assert planner.slope_ms == 0.0  # 9 < 10 samples
    planner.update_runtime(2, 8, forward_ms=50.0)
    assert planner.slope_ms == pytest.approx(5.0)
    fast = VarlenPlanner(CostCurve([(4, 10.0), (8, 10.0)]), 5)
    for _ in range(10):
        fast.update_runtime(2, 4, forward_ms=2.0)
    assert fast.slope_ms == 0.0


def test_slope_is_the_median_of_per_size_medians_over_a_window():
    planner = VarlenPlanner(CostCurve([(4, 0.5), (8, 0.5), (16, 0.5)]), 5, slope_window=30, slope_min_samples=3)
    for _ in range(3):
        planner.update_runtime(1, 4, 0.5 + 4 * 1.0)
        planner.update_runtime(1, 8, 0.5 + 8 * 2.0)
        planner.update_runtime(1, 16, 0.5 + 16 * 10.0)
    assert planner.slope_ms == pytest.approx(2.0)  # sizes weigh the same, outlier size does not drag it
    for _ in range(30):  # the window forgets the old steps
        planner.update_runtime(1, 4, 0.5 + 4 * 3.0)
    assert planner.slope_ms == pytest.approx(3.0)


def test_sampler_time_per_batch_size_with_global_fallback():
    planner = VarlenPlanner(CostCurve([(4, 1.0)]), 5)
    for _ in range(4):
        planner.update_runtime(2, 4, 1.0, sampler_ms=3.0)
    assert planner.sampler_ms(2) == 0.0  # fewer than 5 samples anywhere
    planner.update_runtime(2, 4, 1.0, sampler_ms=3.0)
    assert planner.sampler_ms(2) == pytest.approx(3.0)
    assert planner.sampler_ms(3) == pytest.approx(3.0)  # unseen batch size: global median
    for _ in range(5):
        planner.update_runtime(3, 4, 1.0, sampler_ms=7.0)
    assert planner.sampler_ms(3) == pytest.approx(7.0)
    assert planner.step_ms(3, 3) == pytest.approx(1.0 + 7.0)
    assert planner.step_ms(5, 3) is None


def test_sampler_time_shifts_the_choice_toward_more_drafts():
    # a fixed per-step cost makes each step dearer, so speculating more per step pays off
    curve = CostCurve([(1, 1.0), (2, 2.0), (3, 3.0)])
    planner = VarlenPlanner(curve, 2)
    rates = [[0.9, 0.8]]
    assert planner.plan(rates, rates, [2]) == [0]  # 1/1 > 1.9/2 > 2.7/3
    for _ in range(5):
        planner.update_runtime(1, 1, 1.0, sampler_ms=10.0)
    assert planner.plan(rates, rates, [2]) == [2]  # 2.7/13 > 1.9/12 > 1/11


def test_steps_past_the_curve_only_update_the_sampler():
    planner = VarlenPlanner(CostCurve([(4, 1.0)]), 5, slope_min_samples=1)
    planner.update_runtime(1, 100, forward_ms=500.0, sampler_ms=1.0)
    assert planner.slope_ms == 0.0


# --- the curve, its profiling and its cache ---------------------------------------------------------------------


def test_curve_validates_points_and_buckets_to_the_next_size():
    with pytest.raises(ValueError):
        CostCurve([(4, 1.0), (4, 2.0)])
    with pytest.raises(ValueError):
        CostCurve([(4, 0.0)])
    c = CostCurve([(4, 1.0), (8, 2.0)])
    assert (c.bucket(1), c.bucket(4), c.bucket(5), c.bucket(9)) == ((4, 1.0), (4, 1.0), (8, 2.0), None)


def test_profile_times_each_size_with_warmup_and_trimmed_median():
    clock = [0.0]
    calls = []
    durations = {}  # size -> iterator of seconds per call (warmup included)
    for n in (2, 8):
        # warmup (ignored), then 5 timed runs with one outlier at each end
        durations[n] = iter([9.0, 0.010 * n, 0.011 * n, 0.012 * n, 0.001, 5.0])

    def run(n):
        calls.append(n)
        clock[0] += next(durations[n])

    curve = profile_cost_curve(run, [8, 2, 2], warmup=1, repeats=5, timer=lambda: clock[0])
    assert calls == [8] * 6 + [2] * 6  # largest first, duplicates dropped
    assert [n for n, _ in curve.points] == [2, 8]
    assert [ms for _, ms in curve.points] == pytest.approx([11.0 * 2, 11.0 * 8])


def test_cache_round_trip_ttl_and_key_change(tmp_path):
    key = {"model": "/models/v41-flash", "device": "NVIDIA H200", "dtype": "bf16", "sizes": SIZES}
    path = perf_cache_path(tmp_path / "perf", key)
    assert path is not None and perf_cache_path(None, key) is None and perf_cache_path("", key) is None
    curve = CostCurve([(1, 2.5), (8, 3.0), (64, 9.75)])
    assert CostCurve.load(path, ttl_s=3600) is None  # nothing saved yet
    curve.save(path)
    assert CostCurve.load(path, ttl_s=3600) == curve
    saved_at = json.loads(path.read_text())["saved_at"]
    assert CostCurve.load(path, ttl_s=3600, now=saved_at + 3599) == curve
    assert CostCurve.load(path, ttl_s=3600, now=saved_at + 3601) is None  # expired
    assert CostCurve.load(path, ttl_s=None, now=saved_at + 10**9) == curve
    assert perf_cache_path(tmp_path / "perf", dict(key)) == path  # same key, same file
    for change in ({"device": "NVIDIA H100"}, {"dtype": "fp8"}, {"sizes": SIZES[:-1]}, {"draft": 5}):
        other = perf_cache_path(tmp_path / "perf", {**key, **change})
        assert other != path and CostCurve.load(other, ttl_s=3600) is None
    assert [p.name for p in (tmp_path / "perf").iterdir()] == [path.name]  # no temp files left


def test_corrupt_cache_file_is_a_miss(tmp_path):
    path = tmp_path / "c.json"
    for text in ("{", "[]", '{"format": 1, "saved_at": 0, "points": [[4, -1]]}', '{"format": 99}'):
        path.write_text(text)
        assert CostCurve.load(path, ttl_s=None) is None


def test_load_or_profile_profiles_once_then_reads_the_cache(tmp_path):
    runs = []
    clock = [0.0]

    def run(n):
        runs.append(n)
        clock[0] += 0.001 * n

    key = {"model": "m"}
    a = load_or_profile_cost_curve(tmp_path, key, 3600, run, [1, 4], repeats=3, timer=lambda: clock[0])
    assert runs and [n for n, _ in a.points] == [1, 4]
    assert [ms for _, ms in a.points] == pytest.approx([1.0, 4.0])
    runs.clear()
    b = load_or_profile_cost_curve(tmp_path, key, 3600, run, [1, 4], repeats=3, timer=lambda: clock[0])
    assert runs == [] and b == a


def test_module_imports_nothing_but_the_standard_library():
    # the scheduler is pure Python: no torch (or numpy) import in this module, at any level
    tree = ast.parse(Path(spec_schedule.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
