"""Prefix caching never changes an output with the engine's other features on: DSpark drafting, structured outputs
and YOCO prefill truncation. The chat workload of test_prefix_cache_exactness (a shared system prompt, a first round,
a second turn resending the history; 32-token chunks, a cache small enough to preempt) served with
cache.prefix_caching=true and with false gives bitwise the same tokens and logprobs, and the requests that should hit
did (their num_cached_tokens).
"""

from __future__ import annotations

import pytest

from deepinfer.sampling import SamplingParams
from test_prefix_cache_exactness import params, serve

REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.com"
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "maxLength": 4}}, "required": ["id", "tag"]}
K = 24  # yoco.keep_tokens on tiny_random (window 16): the rectangle cuts every prompt of the workload


def assert_exact_with_hits(cached_run, uncached_run, first_round_hits: int = 4):
    (got, cached, (m1, m2)), (want, no_cached, _) = cached_run, uncached_run
    assert got == want
    assert not any(no_cached)
    assert sum(c >= 64 for c in cached[1:7]) >= first_round_hits, cached
    assert all(c >= 16 for c in cached[7:]), cached  # every second turn starts after a cached part of its first
    # (readmissions after a preemption hit too, and count in the run's figures)
    assert m1["prefix_cache"]["hit_tokens"] + m2["prefix_cache"]["hit_tokens"] >= sum(cached[1:])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy-preempted", "seeded"])
def test_dspark_drafting_with_prefix_hits_gives_the_tokens_and_logprobs_of_no_cache(sampled):
    """The draft layers' rings are part of the slot a checkpoint copies (taken before the step's drafting), and a
    restored slot drafts from them as the cold sequence does; verification rolls back only over its own drafts.
    Seeded sampling without preemption: the first token after a recompute is drawn plainly, where the run that was
    not preempted drew it by speculative verification (same distribution, other draw), so DSpark's sampled outputs
    depend on preemption with or without the prefix cache."""
    dspark = ("decoding=dspark", "decoding.num_draft_tokens=3")
    blocks = 40 if sampled else 11
    on = serve("embedded:tiny", True, True, sampled, *dspark, blocks=blocks)
    off = serve("embedded:tiny", False, True, sampled, *dspark, blocks=blocks)
    assert_exact_with_hits(on, off)
    m1, m2 = on[2]
    assert m1["speculative"]["accepted_tokens"] + m2["speculative"]["accepted_tokens"] > 0, "drafts were accepted"
    preempted = m1["preemptions"] + m2["preemptions"]
    assert preempted > 0 if not sampled else preempted == 0


def structured(sampled: bool, i: int) -> SamplingParams:
    """Every other request is constrained, by a JSON schema or a regex (seeded sampling, or greedy)."""
    so = [{"schema_type": "json", "schema": SCHEMA}, None, {"schema_type": "regex", "schema": REGEX}][i % 3]
    return SamplingParams(temperature=0.8 if sampled else 0.0, seq_seed=1000 + i, max_tokens=20, top_logprobs=2,
                          so_args=so)


def test_structured_outputs_with_prefix_hits_give_the_tokens_and_logprobs_of_no_cache():
    """A request whose grammar is compiling may hit too (it stops short of the last two known tokens); the grammar
    constrains only the tokens sampled after the prompt, which a hit leaves as they are."""
    on = serve("embedded:tiny", True, False, True, make_params=structured, finish=("length", "stop"))
    assert_exact_with_hits(on, serve("embedded:tiny", False, False, True, make_params=structured,
                                     finish=("length", "stop")))


@pytest.mark.parametrize("mode, sampled, extra", [("mask", False, ()), ("compact", False, ()),
                                                   ("compact", True, ("decoding=dspark", "decoding.num_draft_tokens=3"))],
                         ids=["mask", "compact", "compact-dspark-seeded"])
def test_yoco_with_prefix_hits_gives_the_tokens_and_logprobs_of_no_cache(mode, sampled, extra):
    """Under YOCO the decoder layers' window rows before a request's rectangle (its known length - keep_tokens) are
    cut (mask) or never written (compact), so a checkpoint holds them truncated; a request hits only at a boundary
    at or before its own rectangle, where its decoder layers read nothing from before the boundary. (Hitting
    further, at the prompt's end, changed requests' outputs here.) No preemption: a YOCO recompute's rectangle
    moves (docs/yoco.md), so YOCO's outputs depend on preemption with or without the prefix cache."""
    yoco = (f"yoco={mode}", f"yoco.keep_tokens={K}", *extra)
    on = serve("embedded:tiny-random", True, False, sampled, *yoco, blocks=40)
    off = serve("embedded:tiny-random", False, False, sampled, *yoco, blocks=40)
    assert_exact_with_hits(on, off, first_round_hits=2)
    assert on[2][0]["preemptions"] + on[2][1]["preemptions"] + off[2][0]["preemptions"] == 0
