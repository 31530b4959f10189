"""Expert-parallel decode steps and CUDA graphs, on the CPU (capturing needs CUDA; tests/gpu/test_expert_parallel_gpu.py
runs real graphs on one GPU):
- a static EP decode step of the model reads nothing on the host outside the registered kernel ops (tests/host_reads.py
  looks for the operations that would sync with a CUDA device or that a graph cannot hold), and under the path the
  runner pinned it runs no agreement collective; the variable path does read its counts (the spy can fail);
- the capture decision: under EP a decode graph serves only buckets within the static buffers, and the engine with an
  EP model replays graphs for its decode steps (emulated on the CPU: tests/emulated_graphs.py) and returns the tokens
  of the same model without EP;
- (slow) dep2 with graphs: the ranks capture buckets at different steps, a rank without a capture pairs the other's
  warm-up with one extra static forward in the same step, and the tokens are single's.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer import LLM, embedded
from deepinfer.cli.requests import generate_requests
from deepinfer.models import ForwardBatch, load_model

TESTS = Path(__file__).resolve().parent
N_EXP = 8  # the embedded tiny model's routed experts


def _ep_model(rank: int = 0, world: int = 1, max_tokens: int = 4):
    from deepinfer.distributed import groups
    from deepinfer.distributed.placement import ExpertPlacement

    group = groups.init_group(rank, world, f"tcp://127.0.0.1:{_port()}", "cpu", timeout_s=60)
    return load_model(embedded.materialize("tiny-random"), draft_layers=False, ep_group=group, ep_rank=rank,
                      expert_placement=ExpertPlacement.initial(N_EXP, world), ep_max_tokens=max_tokens)


def _port() -> int:
    import os

    return int(os.environ["EP_TEST_PORT"])


def _spy_worker(_rank: int) -> None:
    sys.path.insert(0, str(TESTS))
    from host_reads import HostReads

    from deepinfer.distributed import expert_parallel as ep_mod
    from deepinfer.distributed import groups
    from deepinfer.distributed.ep_dispatch import StepPath
    from deepinfer.models.step import prepare_step

    torch.set_num_threads(1)
    model = _ep_model()
    try:
        states = [model.new_state() for _ in range(3)]
        model.forward(ForwardBatch([[5, 6, 7], [8, 9], [10]], states))  # prefill: more tokens than the buffers hold
        assert not model.expert_parallel.static  # ... so the variable path
        spy = HostReads()
        for kind in list(model.ops._fns):  # the kernels: TileLang on CUDA, inside single's graphs already
            model.ops._fns[kind] = spy.pause(model.ops._fns[kind])
        agreements = []
        agree = ep_mod.agree_static
        ep_mod.agree_static = lambda *a: agreements.append(a) or agree(*a)
        ep_mod._check_distinct = spy.pause(ep_mod._check_distinct)  # a CPU-only check (the ids on the host)
        for token, pinned in ((11, True), (12, False)):
            step = prepare_step(ForwardBatch([[token], [token + 1], [token + 2]], states), model.device,
                                model.config.compress_ratios)
            spy.reads.clear()
            with model.expert_parallel.pin(StepPath(pinned, 0, 3 if pinned else 0)), spy:
                model.run(step.meta, step.pools)
            step.advance()
            assert model.expert_parallel.static == pinned
            if pinned:
                assert spy.reads == [], spy.reads  # the static step: nothing read on the host
            else:  # the variable path reads each layer's row counts: the spy sees them
                assert any("Tensor.tolist at distributed/expert_parallel.py" in r for r in spy.reads), spy.reads
        assert agreements == []  # pinned or not, the path came from the pin: no per-forward collective
    finally:
        groups.destroy()


def _spawn(fn, nprocs: int, monkeypatch, *args) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("EP_TEST_PORT", str(s.getsockname()[1]))
    mp.spawn(fn, args=args, nprocs=nprocs, join=True)


@pytest.mark.timeout(120)
def test_a_static_ep_decode_step_reads_nothing_on_the_host(monkeypatch):
    _spawn(_spy_worker, 1, monkeypatch)


def test_under_ep_a_decode_graph_serves_only_buckets_within_the_static_buffers():
    from deepinfer.engine.cuda_graphs import DecodeGraphs

    model = load_model(embedded.materialize("tiny-random"), draft_layers=False)
    pools = model.allocate_cache(8, 32, 16)
    state = model.new_state()
    graphs = DecodeGraphs(model, pools, max_batch=8, interval=8, max_blocks=4, max_length=1, max_tokens=4,
                          collective=True)
    assert graphs.sizes == [1, 2, 4, 8]
    key = graphs.key_for([[1]] * 3, [state] * 3)
    assert key == (4, 1, 1) and graphs.tokens(key) == 4 and graphs.needs_capture(key)
    assert graphs.key_for([[1]] * 5, [state] * 5) is None  # bucket 8: 8 tokens > the buffers' 4: runs eagerly
    assert graphs.key_for([[1], [1, 2]], [state] * 2) is None  # sequences of different lengths
    free = DecodeGraphs(model, pools, max_batch=8, interval=8, max_blocks=4)
    assert free.key_for([[1]] * 5, [state] * 5) == (8, 1, 1)  # without EP every bucket serves


PROMPTS = [[5, 77, 301, 9, 12, 40], [3, 4], list(range(100, 117)), [450, 451, 452]]


def _engine_worker(_rank: int, out: str) -> None:
    sys.path.insert(0, str(TESTS))
    from emulated_graphs import install

    from deepinfer import SamplingParams
    from deepinfer.config.schema import Settings
    from deepinfer.distributed import groups
    from deepinfer.engine import EngineOptions
    from deepinfer.engine.backend import backend_from_model
    from deepinfer.frontend import LLMEngine

    torch.set_num_threads(1)
    install(str(Path(out).parent))
    model = _ep_model(max_tokens=4)
    ep = model.expert_parallel
    # 8, 6, 4 and 3 new tokens: decode batches of 4, 3, 2 and 1 sequences (graph buckets 4, 2 and 1)
    sp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 6, 4, 3)]
    runs = {}
    try:
        for name, graphs in (("single", False), ("ep", True)):
            model.expert_parallel = ep if name == "ep" else None
            opts = EngineOptions.for_settings(Settings(), max_num_seqs=4, memory_budget=64 << 20, process="inproc",
                                              enforce_eager=not graphs, seed=0)
            with LLMEngine(lambda: backend_from_model(model), opts) as engine:
                outs = engine.generate(PROMPTS, sp, use_tqdm=False)
                runner = engine.client.core.runner
                runs[name] = dict(tokens=[o.token_ids for o in outs], metrics=engine.last_metrics,
                                  records=runner.graphs.records if graphs else 0,
                                  keys=sorted(runner.graphs._graphs) if graphs else [])
    finally:
        groups.destroy()
    Path(out).write_text(json.dumps(runs))


@pytest.mark.timeout(120)
def test_the_engine_replays_ep_decode_graphs_and_returns_the_tokens_without_ep(tmp_path, monkeypatch):
    out = tmp_path / "runs.json"
    _spawn(_engine_worker, 1, monkeypatch, str(out))
    runs = json.loads(out.read_text())
    assert runs["ep"]["tokens"] == runs["single"]["tokens"]
    m = runs["ep"]["metrics"]
    assert runs["ep"]["records"] == 3 and m["graph_steps"] == 7, m  # every decode-only step replayed
    # one rank: each graph bakes in the capacity of its own bucket (batch bucket, blocks, length, capacity tokens)
    assert runs["ep"]["keys"] == [[1, 1, 1, 1], [2, 1, 1, 2], [4, 1, 1, 4]], runs["ep"]["keys"]
    logged = [line.split() for f in tmp_path.glob("*.txt") for line in f.read_text().splitlines()]
    replays = [l for l in logged if l[4] == "replay=1"]
    assert len(replays) == m["graph_steps"] and all(l[5] == "static=1" for l in replays)


SITECUSTOMIZE = '''
import os, sys
if os.environ.get("EP_GRAPH_LOG"):
    sys.path.insert(0, os.environ["EP_GRAPH_TESTS"])
    from emulated_graphs import install
    install(os.environ["EP_GRAPH_LOG"])
'''


def workload() -> list[dict]:
    """24 greedy requests of 1..40 prompt tokens and 2..9 new tokens: the ranks' batch sizes differ from step to
    step, so they capture different buckets at different steps."""
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))],
             "max_tokens": rng.randint(2, 9), "temperature": 0.0, "ignore_eos": True} for _ in range(24)]


@pytest.mark.slow  # multi-process: the fast tier keeps one dep2 engine run
@pytest.mark.timeout(300)
@pytest.mark.parametrize("decoding", ["plain", "dspark"])
def test_dep2_pairs_each_capture_and_returns_the_tokens_of_single(tmp_path, monkeypatch, decoding):
    """With DSpark the verification steps (every sequence 1 + 3 tokens) replay graphs of their own."""
    requests = workload()
    engine = {"max_num_seqs": 6}
    overrides = ["decoding=dspark", "decoding.num_draft_tokens=3"] if decoding == "dspark" else []
    with LLM("tiny_random", process="inproc", engine=engine, runtime={"num_threads": 1}, overrides=overrides) as llm:
        single = [o.token_ids for o in generate_requests(llm, requests)]
    site, log = tmp_path / "site", tmp_path / "log"
    site.mkdir()
    log.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{TESTS.parent}")
    monkeypatch.setenv("EP_GRAPH_LOG", str(log))
    monkeypatch.setenv("EP_GRAPH_TESTS", str(TESTS))
    with LLM("tiny_random", parallel="dep2", engine=engine, runtime={"num_threads": 1}, overrides=overrides) as llm:
        got = [o.token_ids for o in generate_requests(llm, requests)]
        metrics = llm.last_metrics
    if decoding == "dspark":
        assert metrics["speculative"]["verifications"] > 0
    assert got == single
    ranks = [[dict(kv.split("=") for kv in line.split()[2:]) for line in f.read_text().splitlines()]
             for f in sorted(log.glob("*.txt"))]
    assert len(ranks) == 2 and len(ranks[0]) == len(ranks[1])  # one agreed forward step per turn on each rank
    steps = list(zip(*ranks))
    for a, b in steps:  # a capture on one rank is paired on the other in the same step; both agreed one path
        assert int(a["pair"]) == int(b["capture"]) and int(b["pair"]) == int(a["capture"]) or \
            a["capture"] == b["capture"] == "1", (a, b)
        assert a["static"] == b["static"]
    assert any(int(a["capture"]) != int(b["capture"]) for a, b in steps)  # the case this test exists for
    replays = sum(int(s["replay"]) for r in ranks for s in r)
    assert replays > 0 and metrics["graph_steps"] == replays, (replays, metrics["graph_steps"])


def test_no_host_reads_is_scoped_and_per_thread():
    """The switch that makes kernel launchers take the paths a graph capture takes (kernels/registry.py): the EP
    static path and a graph's warm-up set it; it nests, ends with its block and does not leak to other threads."""
    import threading

    from deepinfer.kernels.registry import host_reads_allowed, no_host_reads

    assert host_reads_allowed()
    seen = []
    with no_host_reads():
        with no_host_reads():
            assert not host_reads_allowed()
        assert not host_reads_allowed()
        t = threading.Thread(target=lambda: seen.append(host_reads_allowed()))
        t.start()
        t.join()
    assert host_reads_allowed() and seen == [True]
