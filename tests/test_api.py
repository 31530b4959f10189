"""The Python API: LLM(model=..., **overrides).generate(...) -> RequestOutput, exact against the golden fixtures."""

from pathlib import Path

import dataclasses
import pytest
import torch
from safetensors import safe_open

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.config.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41"
GREEDY16 = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def cases(fixture: str):
    with safe_open(str(FIXTURES / fixture / "cases.safetensors"), "pt") as f:
        n = len({k.split(".")[0] for k in f.keys()})
        return [
            (f.get_tensor(f"case{i}.input_ids").tolist(), f.get_tensor(f"case{i}.greedy_ids").tolist()) for i in range(n)
        ]


@pytest.fixture(scope="module")
def llm():
    with LLM(model=str(FIXTURES / "tiny-engram-hc4"), runtime={"num_threads": 1}) as llm:
        yield llm


@pytest.mark.parametrize("fixture", ["tiny-swa-csa2", "tiny-engram-hc4", "tiny-swa-csa2-fp8fp4"])
def test_greedy_generation_reproduces_the_fixture_continuations(fixture):
    torch.set_num_threads(1)
    expected = cases(fixture)
    with LLM(model=str(FIXTURES / fixture)) as llm:
        outs = llm.generate(prompt_token_ids=[ids for ids, _ in expected], sampling_params=GREEDY16, use_tqdm=False)
    assert [o.token_ids for o in outs] == [greedy for _, greedy in expected]
    assert all(o.finish_reason == "length" and o.error is None for o in outs)


def test_text_prompts_are_tokenized_with_bos_and_answered_in_input_order(llm):
    expected = cases("tiny-engram-hc4")
    texts = ["The cat sat on the mat all day long.", "The quick brown fox jumps over the lazy dog, then naps in the sun."]
    outs = llm.generate(texts, GREEDY16, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert [o.prompt for o in outs] == texts
    assert [o.prompt_token_ids for o in outs] == [expected[0][0], expected[1][0]]
    assert [o.token_ids for o in outs] == [expected[0][1], expected[1][1]]
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)


def test_one_sampling_params_per_prompt_and_logprobs(llm):
    ids = cases("tiny-engram-hc4")[0][0]
    outs = llm.generate(
        [{"prompt_token_ids": ids}, ids],
        [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, top_logprobs=3, prompt_logprobs=True)],
        use_tqdm=False,
    )
    assert [len(o.token_ids) for o in outs] == [2, 5]
    assert outs[1].token_ids[:2] == outs[0].token_ids
    lp = outs[1].logprobs[0]
    assert lp.token_id == outs[1].token_ids[0] and lp.logprob <= 0 and len(lp.top_logprobs) == 3
    assert lp.top_logprobs[0][0] == lp.token_id  # greedy picks the most likely token
    assert outs[1].prompt_logprobs[0] is None and len(outs[1].prompt_logprobs) == len(ids)
    m = outs[1].metrics
    assert m.num_prompt_tokens == len(ids) and m.num_output_tokens == 5 and m.e2e_latency >= m.time_to_first_token >= 0


def test_invalid_requests_end_with_an_error_and_the_others_still_run(llm):
    too_long = [0] + [5] * 1030
    outs = llm.generate(
        [[], too_long, [0, 9999], "ok"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )
    assert [o.finish_reason for o in outs] == ["error", "error", "error", "length"]
    assert "prompt is empty" in outs[0].error
    assert "max_model_len is 1024" in outs[1].error
    assert "token id 9999 is outside the vocabulary" in outs[2].error
    assert outs[3].error is None and len(outs[3].token_ids) == 2


def test_a_request_that_cannot_fit_the_context_ends_with_an_error(llm):
    prompt = [0] + [5] * 1020  # max_model_len 1024 leaves room for 3 tokens, not 10
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "error" and "max_model_len" in out.error and out.token_ids == []


def test_a_stop_token_id_ends_the_request_with_stop_and_is_kept(llm):
    ids = cases("tiny-engram-hc4")[0][0]
    greedy = cases("tiny-engram-hc4")[0][1]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[greedy[3]]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(greedy[3]) + 1]


def test_seq_seed_makes_sampling_reproducible(llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seq_seed=1234)
    a, b = llm.generate(["def f(", "def f("], params, use_tqdm=False)
    assert a.token_ids == b.token_ids
    c = llm.generate(["def f("], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seq_seed=99),
                     use_tqdm=False)[0]
    assert c.token_ids != a.token_ids


def test_default_sampling_params_come_from_the_config(llm):
    assert llm.default_sampling_params().max_tokens == llm.settings.sampling.max_tokens == 16
    assert len(llm.generate("x", use_tqdm=False)[0].token_ids) <= 16


def test_close_and_context_manager():
    with LLM(model=str(FIXTURES / "tiny-swa-csa2"), runtime={"num_threads": 1}) as llm:
        assert llm.generate("a", SamplingParams(max_tokens=1), use_tqdm=False)[0].finish_reason in ("length", "stop")
    with pytest.raises(RuntimeError, match="after close"):
        llm.generate("a")


def test_config_errors_raise_one_line_before_loading():
    with pytest.raises(ConfigError, match=r"^sampling.top_p=2.0 is out of range; allowed: \(0, 1\]$"):
        LLM(sampling={"top_p": 2})
    with pytest.raises(ConfigError, match="unknown argument 'gpu'"):
        LLM(gpu=True)


def test_n_samples_are_independent_and_the_first_equals_the_single_sample(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seq_seed=77)
    single = llm.generate([[0, 5, 6, 7]], sp, use_tqdm=False)[0]
    many = llm.generate([[0, 5, 6, 7]], dataclasses.replace(sp, n=4), use_tqdm=False)[0]
    assert len(many.samples) == 4
    assert many.samples[0].token_ids == single.token_ids == many.token_ids
    assert len({tuple(s.token_ids) for s in many.samples}) > 1  # different seeds, different draws
    again = llm.generate([[0, 5, 6, 7]], dataclasses.replace(sp, n=4), use_tqdm=False)[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in many.samples]


def test_with_a_subprocess_engine_the_frontend_holds_no_weights(llm):
    from deepinfer.models.card import ModelCard

    assert llm.settings.engine.process == "subprocess"
    assert isinstance(llm.program.model, ModelCard)  # checked checkpoint + tokenizer; the engine core has the weights
    assert llm.program.summary()["ops"]["sink_attention"] == "torch"


def test_with_an_in_process_engine_only_the_core_builds_the_model():
    """One construction path: the frontend loads config and tokenizer; the core, here in this process, builds the
    model from the settings (SettingsBackend), not from the frontend's program."""
    from deepinfer.models.card import ModelCard

    with LLM(model=str(FIXTURES / "tiny-swa-csa2"), hardware="cpu", process="inproc") as llm:
        assert isinstance(llm.program.model, ModelCard)
        core_model = llm._engine.client.core.runner.backend.model
        assert not isinstance(core_model, ModelCard) and core_model.config == llm.program.model.config
        assert llm.generate([[0, 5, 6]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].token_ids


def test_a_checkpoint_is_checked_in_the_frontend_even_without_loading_its_weights(tmp_path):
    import shutil

    from deepinfer.models.loading import CheckpointError, load_checkpoint

    bad = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tiny-swa-csa2-fp8fp4", bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_checkpoint(bad, weights=False)
    assert load_checkpoint(FIXTURES / "tiny-swa-csa2-fp8fp4", weights=False).weights == {}
