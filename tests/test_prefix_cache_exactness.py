"""Prefix caching never changes an output: a chat workload served with cache hits gives bitwise the tokens and
logprobs it gives with cache.prefix_caching=false.

The workload: a shared system prompt, a first round of requests (each the system prompt + a unique question),
then a second turn of some of them (the first turn's prompt + its answer + a new question, as a chat front-end
resends the history). A small token budget chunks every prompt and mixes it with decodes, and a small cache
preempts requests (their recompute may itself start from a cached prefix). Models: the embedded one (window 64,
Engram, FP8/FP4 caches) and the fixtures with compression ratios 1 and 2 and the indexer (tiny-swa-csa2) and with
Engram (tiny-engram-hc4); greedy and seeded sampling; synchronous and async scheduling.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deepinfer.frontend import LLMEngine
from deepinfer.sampling import SamplingParams
from model_fixtures import FIXTURES
from options_helpers import settings_for

MODELS = {"embedded": "embedded:tiny", "csa2": str(FIXTURES / "tiny-swa-csa2"),
          "engram": str(FIXTURES / "tiny-engram-hc4")}
BLOCK = 16


def engine(model: str, prefix_caching: bool, zero_overhead: bool, *overrides: str, blocks: int = 11) -> LLMEngine:
    """A chunking (32-token steps), preempting engine: 4 sequences' state and 11 blocks of context (`blocks`), and
    (with prefix caching) 6 window checkpoints; the same budget without. Slots as prefix caching lays them out (the rings keep
    a block's worth of rows more: the end-of-prompt checkpoint is taken up to a block past its boundary)."""
    kw = dict(process="inproc", zero_overhead_scheduling=zero_overhead, max_num_batched_tokens=32, max_num_seqs=4,
              block_size=BLOCK)
    slot, block = layout_bytes(settings_for(model, *overrides, **kw), checkpoint_lag=BLOCK - 1)
    budget = 10 * slot + blocks * block
    return LLMEngine.for_settings(settings_for(
        model, f"cache.prefix_caching={str(prefix_caching).lower()}", "cache.prefix_checkpoint_interval=4",
        f"cache.prefix_checkpoint_fraction={6.5 * slot / budget}", *overrides, memory_budget=budget, **kw))


def layout_bytes(settings, checkpoint_lag: int = 0) -> tuple[int, int]:
    """Slot and block bytes as the engine lays them out for `settings` (DSpark: its draft rings and rollback rows)."""
    from deepinfer.models import ModelConfig
    from deepinfer.models.cache import CacheLayout
    from deepinfer.pipeline.build import model_location

    cfg = ModelConfig.from_file(Path(model_location(settings.model.path)) / "config.json")
    drafts = cfg.num_nextn_predict_layers if settings.decoding.name == "dspark" else 0
    layout = CacheLayout(cfg, getattr(torch, settings.model.dtype), BLOCK, settings.decoding.max_rollback, drafts,
                         checkpoint_lag=checkpoint_lag)
    return layout.slot_bytes(), layout.block_bytes()


def chat(vocab: int, seed: int = 7):
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system = words(70)
    return system, [system + words(rng.randint(4, 40)) for _ in range(6)], [words(rng.randint(5, 30)) for _ in range(3)]


def params(sampled: bool, i: int) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=0.8, top_p=0.95, seq_seed=1000 + i, max_tokens=20, ignore_eos=True,
                              top_logprobs=2)
    return SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, top_logprobs=2)


def serve(model: str, prefix_caching: bool, zero_overhead: bool, sampled: bool, *overrides: str,
          make_params=params, finish=("length",), blocks: int = 11):
    """Both rounds of the chat on one engine: outputs as (tokens, logprobs) per request, cached tokens, metrics.
    make_params(sampled, i): request i's SamplingParams; finish: the finish reasons every request must end with;
    blocks: the engine's blocks of context (11 preempts)."""
    with engine(model, prefix_caching, zero_overhead, *overrides, blocks=blocks) as eng:
        system, first, follow_ups = chat(eng.info.vocab_size)
        warm = eng.generate([system + [5, 6, 7]], [make_params(sampled, 99)], use_tqdm=False)
        one = eng.generate(first, [make_params(sampled, i) for i in range(len(first))], use_tqdm=False)
        m1 = eng.last_metrics
        second = [first[i] + one[i].token_ids + q for i, q in enumerate(follow_ups)]
        two = eng.generate(second, [make_params(sampled, 10 + i) for i in range(len(second))], use_tqdm=False)
        m2 = eng.last_metrics
    outs = warm + one + two
    got = [(o.token_ids, [(t.token_id, t.logprob, t.top_logprobs) for t in o.logprobs]) for o in outs]
    assert all(o.finish_reason in finish for o in outs), [(o.finish_reason, o.error) for o in outs]
    return got, [o.num_cached_tokens for o in outs], (m1, m2)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]


@pytest.fixture(scope="module", params=[False, True], ids=["greedy", "seeded"])
def sampled(request):
    return request.param


@pytest.fixture(scope="module")
def uncached(model, sampled):
    return serve(model, False, False, sampled)


@pytest.mark.parametrize("zero_overhead", [False, True], ids=["sync", "async"])
def test_a_chat_served_with_prefix_hits_gives_bitwise_the_tokens_and_logprobs_of_no_cache(model, sampled, uncached,
                                                                                      zero_overhead):
    want, no_cached, (n1, n2) = uncached
    got, cached, (m1, m2) = serve(model, True, zero_overhead, sampled)
    assert got == want
    assert not any(no_cached) and n1["prefix_cache"] is None
    # the hits were real: most of the first round found the system prompt, every second turn its first turn
    assert sum(c >= 64 for c in cached[1:7]) >= 4, cached
    assert all(c >= 64 for c in cached[7:]), cached
    assert m1["prefix_cache"]["hit_tokens"] > 0 and m2["prefix_cache"]["hit_tokens"] >= sum(cached[7:])
    assert m1["prefill_tokens"] + m2["prefill_tokens"] < n1["prefill_tokens"] + n2["prefill_tokens"]
    assert m1["preemptions"] + m2["preemptions"] > 0, "the small cache preempted requests served with hits"


def test_the_end_of_prompt_checkpoint_costs_no_step_and_the_next_turn_still_starts_from_it():
    """A prompt that ends inside a block is not cut at its last block boundary to checkpoint the window there: the
    slot is copied after the step that ends the prompt (the rings keep a block's rows more), so the first turn takes
    as many steps as with the cache off, and the second turn starts at that boundary with the same outputs."""
    prompt = [(i * 7) % 200 + 3 for i in range(150)]  # 32-token chunks, 16-token blocks: the boundary at 144
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = {}
    for on in (False, True):
        with engine("embedded:tiny", on, False) as eng:
            first = eng.generate([prompt], greedy, use_tqdm=False)[0]
            steps = eng.last_metrics["steps"]
            second = eng.generate([prompt + first.token_ids + [5, 6, 7]], greedy, use_tqdm=False)[0]
        runs[on] = (first.token_ids, steps, second.token_ids, second.num_cached_tokens)
    assert runs[True][:3] == runs[False][:3]
    assert runs[True][3] == 144 and runs[False][3] == 0  # block 16: 150 tokens hold nine whole blocks
