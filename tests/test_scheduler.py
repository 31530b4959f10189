"""Scheduler specification, driven by a model-free runner.

The stand-in runner checks what a real model needs (rows continue their sequence exactly where the state left it;
a placeholder is only fed after the token it stands for was sampled) and "samples" a token that is a hash of the
whole sequence so far, so a request's outputs are a pure function of its prompt: any lost, duplicated or
misplaced token under chunking, preemption or async planning changes them.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import pytest

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.plan import SampledToken, StepPlan, StepResult
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler

VOCAB = 97
EOS = 1


def next_token(seq: list[int]) -> int:
    return 2 + zlib.crc32(bytes(str(seq), "ascii")) % (VOCAB - 2)  # never EOS


@dataclass
class Params:
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = True
    stop_token_ids: list | None = None
    stop: list | None = None


def expected_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class HashRunner:
    """Executes plans in order, like the ModelRunner, with the sequence hash as its 'model'."""

    def __init__(self):
        self.seqs: dict[int, list[int]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.release:
            self.seqs.pop(rid, None)
        samples = []
        for row in plan.rows:
            if row.new is not None:
                assert row.request_id not in self.seqs, "admitted twice without a release"
                self.seqs[row.request_id] = []
                known = list(row.new.token_ids)
            seq = self.seqs[row.request_id]
            assert row.start == len(seq), "a row must continue its sequence where the state stopped"
            seq.extend(row.token_ids)
            if row.placeholder:
                assert hasattr(self, "last") and row.request_id in self.last, "placeholder before its sample"
                seq.append(self.last[row.request_id])
            if row.sample:
                samples.append(SampledToken(next_token(seq)))
        self.last = getattr(self, "last", {})
        it = iter(samples)
        for row in plan.rows:
            if row.sample:
                self.last[row.request_id] = next(it).token_id
        return StepResult(plan.step_id, samples)


def make_scheduler(num_blocks=40, block_size=4, fixed_blocks=1, max_num_seqs=8, budget=32, max_model_len=400):
    """`num_blocks` blocks of context, less `fixed_blocks` (the pools' per-sequence state lives in slots)."""
    cache = CacheManager(num_slots=max_num_seqs, num_blocks=num_blocks - fixed_blocks, block_size=block_size)
    return Scheduler(cache, max_num_seqs, budget, max_model_len, VOCAB, eos_token_id=EOS)


def run(sched: Scheduler, arrivals: dict[int, list[Request]], zero_overhead: bool, checks=None):
    """Steps until all work is done; requests in arrivals[k] are added before step k."""
    runner, finished, step = HashRunner(), {}, 0
    inflight = None
    while True:
        for req in arrivals.get(step, []):
            upd = sched.add(req)
            if upd is not None:
                finished[req.request_id] = upd
        if not sched.has_unfinished() and inflight is None and all(k <= step for k in arrivals):
            break
        plan = sched.schedule() if sched.has_unfinished() else StepPlan(-1, [])
        if checks:
            checks(sched, plan)
        if zero_overhead:
            result = runner.execute(plan)  # also applies plan.release when it has no rows
            launched = (plan, result) if plan.rows else None
            if inflight is not None:
                for u in sched.update(*inflight):
                    if u.finish_reason:
                        assert u.request_id not in finished, "a request came back twice"
                        finished[u.request_id] = u
            inflight = launched
        elif plan.rows:
            for u in sched.update(plan, runner.execute(plan)):
                if u.finish_reason:
                    assert u.request_id not in finished, "a request came back twice"
                    finished[u.request_id] = u
        step += 1
        assert step < 20000, "no progress"
    return finished


def random_requests(rng, n, max_prompt=60, max_out=30, first_id=0):
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        reqs.append(Request(first_id + i, prompt, Params(max_tokens=rng.randint(1, max_out)), seed=i))
    return reqs


@pytest.mark.parametrize("zero_overhead", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_every_request_returns_once_with_its_solo_outputs(seed, zero_overhead):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(25, 40), budget=rng.choice([8, 16, 33]), max_num_seqs=rng.choice([5, 16]))
    reqs = random_requests(rng, 40)
    arrivals: dict[int, list[Request]] = {}
    for r in reqs:
        arrivals.setdefault(rng.randrange(0, 60), []).append(r)

    def checks(s: Scheduler, plan: StepPlan):
        assert plan.num_tokens <= s.max_num_batched_tokens
        assert len(plan.rows) <= s.max_num_seqs and len(s.running) <= s.max_num_seqs
        assert len({r.request_id for r in plan.rows}) == len(plan.rows), "one row per request per step"
        assert s.cache.num_used_blocks <= s.cache.num_blocks
        for r in s.running:  # the reservation covers everything the state will hold after this step
            assert len(s.cache.blocks_of(r.request_id)) * s.cache.block_size >= r.num_computed

    finished = run(sched, arrivals, zero_overhead, checks)
    assert sorted(finished) == [r.request_id for r in reqs]
    for r in reqs:
        assert finished[r.request_id].finish_reason == "length"
        assert r.output_ids == expected_outputs(r.prompt_ids, r.params.max_tokens), f"request {r.request_id}"
    assert sched.cache.num_used_blocks == 0, "every block comes back"
    assert sched.num_preemptions > 0, "the cache is small enough to force preemption"


@pytest.mark.parametrize("zero_overhead", [False, True], ids=["sync", "async"])
def test_preemption_takes_the_newest_running_request_first(zero_overhead):
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=24, budget=64, max_num_seqs=8)
    reqs = random_requests(rng, 12, max_prompt=20, max_out=40)
    admitted_order: list[int] = []
    victims: list[tuple[int, list[int]]] = []

    def checks(s: Scheduler, plan: StepPlan):
        for row in plan.rows:
            if row.new is not None:
                admitted_order.append(row.request_id)

    # Record the running order just before each schedule() to know who was newest.
    original = sched._preempt

    def spy(req, plan):
        victims.append((req.request_id, [r.request_id for r in sched.running]))
        original(req, plan)

    sched._preempt = spy
    finished = run(sched, {0: reqs}, zero_overhead, checks)
    assert len(finished) == len(reqs)
    assert victims, "the cache is small enough to force preemption"
    for victim, running in victims:
        assert victim == running[-1], "the victim is the most recently admitted running request"


def test_a_preempted_request_is_readmitted_before_later_arrivals():
    sched = make_scheduler(num_blocks=12, budget=64, max_num_seqs=8)
    a = Request(0, [5] * 10, Params(max_tokens=20), 0)
    b = Request(1, [6] * 10, Params(max_tokens=20), 1)
    c = Request(2, [7] * 4, Params(max_tokens=2), 2)
    for r in (a, b):
        assert sched.add(r) is None
    runner = HashRunner()
    while sched.num_preemptions == 0:
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
    assert b.status is RequestStatus.WAITING and sched.waiting[0] is b
    sched.add(c)
    assert list(sched.waiting) == [b, c]


def test_chunked_prefill_mixes_with_decodes_under_the_token_budget():
    sched = make_scheduler(num_blocks=100, budget=10, max_num_seqs=4)
    runner = HashRunner()
    short = Request(0, [3, 4], Params(max_tokens=10), 0)
    sched.add(short)
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    long = Request(1, list(range(2, 40)), Params(max_tokens=3), 1)
    sched.add(long)
    plan = sched.schedule()
    sizes = {row.request_id: row.num_new_tokens for row in plan.rows}
    assert sizes == {0: 1, 1: 9}, "one decode token, and the prompt chunked into the rest of the budget"
    assert [row.sample for row in plan.rows] == [True, False], "a partial prompt chunk samples nothing"


@pytest.mark.parametrize(
    "prompt,max_tokens,why",
    [
        ([], 4, "empty"),
        ([3] * 400, 4, "max_model_len"),
        ([3] * 390, 20, "exceeds max_model_len"),
        ([3] * 10, 200, "whole budget"),
        ([3, VOCAB + 5], 4, "outside the vocabulary"),
    ],
)
def test_a_request_that_can_never_run_ends_at_once_with_an_error(prompt, max_tokens, why):
    sched = make_scheduler(num_blocks=40, block_size=4, max_model_len=400)  # one sequence: 39 blocks = 156 tokens
    upd = sched.add(Request(0, prompt, Params(max_tokens=max_tokens), 0))
    assert upd is not None and upd.finish_reason == "error" and why in upd.error
    assert not sched.has_unfinished() and sched.cache.num_used_blocks == 0


def test_a_request_filling_the_whole_cache_alone_still_runs_to_the_end():
    sched = make_scheduler(num_blocks=40, block_size=4, fixed_blocks=1)  # 39 blocks of context = 156 tokens
    req = Request(0, [3] * 100, Params(max_tokens=57), 0)  # holds 100 + 57 - 1 = 156 tokens at most
    finished = run(sched, {0: [req]}, zero_overhead=True)
    assert finished[0].finish_reason == "length" and len(req.output_ids) == 57


def test_eos_stops_a_request_and_async_drops_the_token_planned_past_it():
    sched = make_scheduler()
    runner = HashRunner()
    req = Request(0, [5, 6, 7], Params(max_tokens=50, ignore_eos=False), 0)
    sched.add(req)
    want = expected_outputs(req.prompt_ids, 3)
    stop_at = want[2]  # treat the third generated token as a stop token
    req.params.stop_token_ids = [stop_at]
    sched._stoppers[0] = sched._make_stopper(req.params)
    inflight, updates = None, []
    while sched.has_unfinished() or inflight:
        plan = sched.schedule() if sched.has_unfinished() else None
        launched = (plan, runner.execute(plan)) if plan and plan.rows else None
        if inflight:
            updates += sched.update(*inflight)
        inflight = launched
    assert req.output_ids == want and req.finish_reason == "stop"
    assert sum(len(u.token_ids) for u in updates) == 3, "the extra token computed past the stop is not reported"


def test_abort_returns_the_request_once_and_frees_its_cache_and_state():
    sched = make_scheduler()
    runner = HashRunner()
    running = Request(0, [5] * 9, Params(max_tokens=30), 0)
    waiting = Request(1, [6] * 9, Params(max_tokens=30), 1)
    sched.add(running)
    plan = sched.schedule()
    sched.update(plan, runner.execute(plan))
    sched.add(waiting)
    assert sched.abort(0).finish_reason == "abort" and sched.abort(1).finish_reason == "abort"
    assert sched.abort(0) is None, "an aborted request does not come back twice"
    assert not sched.has_unfinished() and sched.cache.num_used_blocks == 0
    assert sched.take_release() == [0], "the runner is told to drop the state it holds"
