"""Balanced context parallel through the engine (issue 13 items 5, 6): parallel=cp2 (experts sharded over the same 2
ranks, as conf/parallel/cp2.yaml) and cp4 with every expert on every rank return exactly the tokens of `single` on
the CPU with gloo, for greedy and seeded sampled requests whose prompts are longer than the test model's 16-token
window and are prefilled in chunks. A sitecustomize on the ranks' PYTHONPATH records every context-parallel split
plan, so the test also sees that the prefill chunks were split over the ranks (each rank computing its mirror
blocks) rather than run whole on each.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.cli.requests import generate_requests

SEED = 7
ENGINE = {"max_num_seqs": 4, "chunked_prefill": True, "max_num_batched_tokens": 24}  # 60-token prompts: 3+ chunks

SITECUSTOMIZE = '''
import os
if os.environ.get("CP_PLAN_LOG"):
    from deepinfer.distributed import context_parallel as _cp
    _plan = _cp.ContextParallel.plan
    def plan(self, lengths, pasts=None, align=1):
        p = _plan(self, lengths, pasts, align)
        with open(os.path.join(os.environ["CP_PLAN_LOG"], f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{self.rank} {self.size} {sum(lengths)} {len(p.rows[self.rank])}\\n")
        return p
    _cp.ContextParallel.plan = plan
'''


def workload(n: int, seed: int) -> list[dict]:
    """n requests, prompts of 17..60 tokens (past the 16-token window), 2..6 new tokens; the last quarter sampled,
    half of those with seq_seed, the others with seeds from runtime.seed."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        line = {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(17, 60))],
                "max_tokens": rng.randint(2, 6)}
        if i < n - n // 4:
            line.update(temperature=0.0, ignore_eos=bool(i % 2))
        else:
            line.update(temperature=0.9, top_p=0.9)
            if i % 2:
                line["seq_seed"] = 1000 + i
        lines.append(line)
    return lines


def _single(requests) -> list[list[int]]:
    with LLM("tiny_random", process="inproc", seed=SEED, engine=ENGINE, runtime={"num_threads": 1}) as llm:
        assert "tiny-random" in llm.settings.model.path  # the random test model (window 16), resolved to a path
        return [o.token_ids for o in generate_requests(llm, requests)]


def _plans(log: Path) -> dict[int, list[tuple[int, int, int]]]:
    """cp rank -> [(cp size, step tokens, rows it computed)] over every split plan the ranks made."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for f in log.glob("*.txt"):
        for line in f.read_text().splitlines():
            rank, size, total, own = map(int, line.split())
            out.setdefault(rank, []).append((size, total, own))
    return out


@pytest.fixture
def plan_log(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "plans"
    log.mkdir()
    monkeypatch.setenv("PYTHONPATH", f"{site}:{Path(__file__).resolve().parents[1]}")
    monkeypatch.setenv("CP_PLAN_LOG", str(log))
    return log


def _check_split(log: Path, cp: int, requests) -> None:
    plans = _plans(log)
    assert sorted(plans) == list(range(cp))  # every rank split prefill steps
    steps = [len(plans[r]) for r in range(cp)]
    assert len(set(steps)) == 1 and steps[0] >= 3  # the same steps on every rank, several chunks
    for r in range(cp):
        assert all(size == cp for size, _, _ in plans[r])
    for i in range(steps[0]):
        total = plans[0][i][1]
        assert all(plans[r][i][1] == total for r in range(cp))
        own = [plans[r][i][2] for r in range(cp)]
        assert max(own) < total  # no rank computed the whole step
    # over the run the prompt tokens were shared out: every rank computed some, none all
    prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    computed = [sum(o for _, _, o in plans[r]) for r in range(cp)]
    assert sum(p[1] for p in plans[0]) >= prompt
    assert all(0 < c < prompt for c in computed)


@pytest.mark.timeout(240)
def test_cp2_returns_the_tokens_of_single_greedy_and_sampled(plan_log):
    requests = workload(16, 5)
    single = _single(requests)
    assert sum(len(t) for t in single) > 40
    with LLM("tiny_random", parallel="cp2", seed=SEED, engine=ENGINE, runtime={"num_threads": 1}) as llm:
        p = llm.settings.parallel
        assert (p.context_parallel_size, p.data_parallel_size, p.expert_parallel_size) == (2, 1, 2)
        got = [o.token_ids for o in generate_requests(llm, requests)]
    assert got[:12] == single[:12]  # greedy
    assert got[12:] == single[12:]  # sampled: seq_seed, and seeds derived from runtime.seed
    _check_split(plan_log, 2, requests)


@pytest.mark.slow  # multi-process: the fast tier keeps one dep2 and one cp2 engine run
@pytest.mark.timeout(240)
def test_cp4_without_expert_parallel_returns_the_tokens_of_single(plan_log):
    requests = workload(6, 11)
    single = _single(requests)
    with LLM("tiny_random", parallel="cp4", seed=SEED, engine=ENGINE, runtime={"num_threads": 1},
             overrides=["parallel.expert_parallel_size=1"]) as llm:
        got = [o.token_ids for o in generate_requests(llm, requests)]
    assert got == single
    _check_split(plan_log, 4, requests)


@pytest.mark.slow  # multi-process: the fast tier keeps one dep2 and one cp2 engine run
@pytest.mark.timeout(300)
def test_cp2_times_dp2_returns_the_tokens_of_single(plan_log):
    """Two data-parallel replicas of two context-parallel ranks each (4 ranks; the experts sharded over each
    replica's 2 ranks): each replica's prefills are split over its own ranks."""
    requests = workload(12, 17)
    single = _single(requests)
    with LLM("tiny_random", parallel="cp2", seed=SEED, engine=ENGINE, runtime={"num_threads": 1},
             overrides=["parallel.data_parallel_size=2"]) as llm:
        p = llm.settings.parallel
        assert (p.world_size, p.context_parallel_size, p.data_parallel_size) == (4, 2, 2)
        got = [o.token_ids for o in generate_requests(llm, requests)]
    assert got == single
    logs = list(plan_log.glob("*.txt"))
    assert len(logs) == 4  # every rank of both replicas split prefill steps
    for f in logs:
        plans = [tuple(map(int, line.split())) for line in f.read_text().splitlines()]
        assert all(size == 2 and own < total for _, size, total, own in plans)


@pytest.mark.slow  # multi-process: the fast tier keeps one dep2 and one cp2 engine run
@pytest.mark.timeout(300)
def test_cp2_with_eplb_replacing_experts_returns_the_tokens_of_single(capfd):
    requests = workload(12, 19)
    single = _single(requests)
    eplb = ["parallel.eplb.redundant_experts=2", "parallel.eplb.interval=4", "parallel.eplb.window=2"]
    with LLM("tiny_random", parallel="cp2", seed=SEED, engine=ENGINE, runtime={"num_threads": 1},
             overrides=eplb) as llm:
        got = [o.token_ids for o in generate_requests(llm, requests)]
    assert got == single
    lines = [line for line in capfd.readouterr().err.splitlines() if "[EPLB] step" in line]
    assert len(lines) >= 2, lines  # the experts were re-placed during the run
