"""The embedded default model (issue 15): the trained checkpoint shipped in the package, read by the ordinary loader.

Its fixtures (tests/fixtures/default_model_greedy.json: greedy tokens of four prompts on the CPU in float32) catch
any change that breaks the model or its loading; its trained draft layers are accepted far more often than random
ones (which are accepted ~never), and drafting stays lossless on it.
"""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from deepinfer import LLM, SamplingParams, embedded
from deepinfer.models.config import ModelConfig

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "default_model_greedy.json").read_text())
pytestmark = pytest.mark.timeout(300)


def test_the_default_is_the_shipped_checkpoint_in_the_released_format():
    path = embedded.materialize("tiny")
    assert path.is_relative_to(Path(embedded.__file__).parent / "assets")  # shipped, never built
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (path / "model.safetensors").stat().st_size < 6_000_000  # the repo carries it
    cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    assert cfg.num_nextn_predict_layers == 3 and cfg.vocab_size == 1536
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["layers.2.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.ffn.experts.1.w1.weight"] == "I8"
    assert dtypes["mtp.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.hc_attn_fn"] == "F32"


def test_greedy_tokens_equal_the_fixtures():
    cases = FIXTURE["cases"]
    with LLM(process="inproc", runtime={"num_threads": 1}) as llm:
        outs = llm.generate([c["prompt"] for c in cases], SamplingParams(temperature=0.0,
                                                                          max_tokens=FIXTURE["max_tokens"]),
                            use_tqdm=False)
    for c, o in zip(cases, outs):
        assert o.prompt_token_ids == c["prompt_token_ids"], c["prompt"]
        assert o.token_ids == c["token_ids"], (c["prompt"], o.text)
    assert "\n    " in outs[0].text  # a function body: the model writes Python, not noise


def test_trained_drafts_are_accepted_and_lossless():
    prompts = [c["prompt"] for c in FIXTURE["cases"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    with LLM(process="inproc", runtime={"num_threads": 1}) as llm:
        plain = llm.generate(prompts, greedy, use_tqdm=False)
    with LLM(process="inproc", runtime={"num_threads": 1}, decoding="dspark") as llm:
        spec = llm.generate(prompts, greedy, use_tqdm=False)
        summary = llm.last_metrics["speculative"]
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # measured 2.2 tokens per verification on 32 held-out headers (benchmarks/results/trained_model_cpu.json);
    # random draft layers give 1.0
    assert summary["mean_accepted_length"] >= 1.6, summary
    assert sum(o.num_accepted_tokens for o in spec) > 0


def test_the_model_group_sets_its_sampling_defaults_and_the_command_line_wins():
    from deepinfer.api import load_settings

    assert load_settings([]).sampling.temperature == 0.3
    assert load_settings(["sampling.temperature=1.0"]).sampling.temperature == 1.0
    assert load_settings(["model=tiny_random"]).sampling.temperature == 1.0  # the schema's default
    other = load_settings(["model.path=" + str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")])
    assert (other.sampling.temperature, other.sampling.max_tokens) == (1.0, 16)  # only for the embedded model
