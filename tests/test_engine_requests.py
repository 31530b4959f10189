"""Every request comes back, in order, as an output or an error with a message; text, stops and metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from deepinfer.engine import EngineOptions, SettingsBackend
from deepinfer.frontend import LLMEngine
from deepinfer.sampling import SamplingParams
from options_helpers import settings_for

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    settings = settings_for(MODEL, process="inproc", max_model_len=128, max_num_batched_tokens=64, memory_budget=1 << 20)
    with LLMEngine.for_settings(settings, Tokenizer.from_file(f"{MODEL}/tokenizer.json")) as eng:
        yield eng


def test_the_engine_reports_its_limits_at_start(engine):
    assert engine.info.max_model_len == 128
    assert engine.info.capacity_tokens > 0 and "capacity" in engine.info.cache_description


def test_valid_and_invalid_requests_all_come_back_in_order(engine):
    ok = [0, 72, 101, 108, 108, 111]
    cases = [
        (ok, GREEDY, None),
        ([], GREEDY, "empty"),
        ([5] * 200, GREEDY, "max_model_len"),
        (ok, SamplingParams(temperature=0.0, max_tokens=500), "exceeds max_model_len"),
        ([0, 7, 99999], GREEDY, "outside the vocabulary"),
        (ok[:3], GREEDY, None),
    ]
    outputs = engine.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    assert [o.request_id for o in outputs] == list(range(len(cases)))
    for out, (prompt, params, why) in zip(outputs, cases):
        assert out.prompt_token_ids == prompt
        if why is None:
            assert out.finish_reason == "length" and len(out.token_ids) == params.max_tokens and out.error is None
        else:
            assert out.finish_reason == "error" and why in out.error and out.token_ids == []
    alone = engine.generate([ok], GREEDY, use_tqdm=False)[0]
    assert outputs[0].token_ids == alone.token_ids, "invalid neighbours do not disturb a valid request"


def test_a_stop_string_ends_the_request_and_is_cut_from_the_text(engine):
    prompt = [0, 35, 36, 37]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert len(free.text) > 4
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    cut = free.text[: free.text.index(stop)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == cut
    assert free.token_ids[: len(out.token_ids)] == out.token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=8, seq_seed=1234, ignore_eos=True)
    alone = engine.generate([[0, 50, 60]], params, use_tqdm=False)[0]
    others = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True)
    batched = engine.generate([[0, 9], [0, 50, 60], [0, 1, 2, 3]], [others, params, others], use_tqdm=False)[1]
    assert batched.token_ids == alone.token_ids


def test_per_run_metrics_add_up(engine):
    prompts = [[0] + [40 + i] * (i + 1) for i in range(5)]
    outputs = engine.generate(prompts, GREEDY, use_tqdm=False)
    m = engine.last_metrics
    assert m["requests"] == 5 and m["errors"] == 0
    assert m["prompt_tokens"] == sum(map(len, prompts))
    assert m["generated_tokens"] == sum(len(o.token_ids) for o in outputs) == 30
    assert m["prefill_tokens"] + m["decode_tokens"] == m["prompt_tokens"] + m["generated_tokens"] - 5
    assert 0 < m["ttft_s"]["p50"] <= m["wall_s"] and m["itl_s"]["p99"] >= m["itl_s"]["p50"] > 0
    assert 0 < m["cache_utilization"]["peak"] <= 1 and m["steps"] >= 6
    for o in outputs:
        assert o.metrics.time_to_first_token > 0 and o.metrics.num_output_tokens == 6
    assert all(len(o.logprobs) == 6 and o.logprobs[0].logprob <= 0 for o in outputs)


def test_prompt_logprobs_over_a_chunked_prompt_match_one_full_forward(engine):
    from deepinfer.models import ForwardBatch, load_model
    from deepinfer.sampling import prompt_logprobs

    prompt = [0] + [(13 * i) % 500 + 3 for i in range(99)]  # 100 tokens: two chunks under the 64-token budget
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=True, top_logprobs=3, ignore_eos=True)
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    model = load_model(MODEL)
    logits = model.forward(ForwardBatch([prompt], [model.new_state()], all_logits=True))
    want = prompt_logprobs(logits, prompt, 3, model.config.vocab_size)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for got, ref in zip(out.prompt_logprobs[1:], want[1:]):
        assert got.token_id == ref.token_id
        assert abs(got.logprob - ref.logprob) < 1e-4
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in ref.top_logprobs]


POISON = 499


class PoisonedBackend:
    """The real model (built from the settings), except that a forward containing token POISON raises (a stand-in for
    a kernel failure)."""

    def __init__(self, settings):
        self.settings = settings

    def __call__(self):
        backend = SettingsBackend(self.settings)()
        forward = backend.prefill

        def poisoned(batch):
            if any(POISON in ids for ids in batch.token_ids):
                raise RuntimeError("injected kernel failure")
            return forward(batch)

        backend.prefill = backend.decode = poisoned
        return backend


@pytest.mark.parametrize("zero_overhead", [False, True], ids=["sync", "async"])
def test_a_failing_step_ends_its_requests_with_an_error_and_the_engine_keeps_serving(zero_overhead):
    settings = settings_for(MODEL, process="inproc", zero_overhead_scheduling=zero_overhead, max_num_batched_tokens=8,
                            memory_budget=1 << 20)
    with LLMEngine(PoisonedBackend(settings), EngineOptions.for_settings(settings)) as engine:
        early = [0, 5, 6]  # admitted first: decoding by the time the poisoned prompt's chunk arrives
        outputs = engine.generate([early, [0] * 12 + [POISON]], GREEDY, use_tqdm=False)
        assert outputs[1].finish_reason == "error" and "injected kernel failure" in outputs[1].error
        # The first request shares the failed step, so it fails too; nothing hangs and nothing is lost.
        assert outputs[0].finish_reason in ("error", "length")
        again = engine.generate([early], GREEDY, use_tqdm=False)[0]
        assert again.finish_reason == "length" and len(again.token_ids) == GREEDY.max_tokens
