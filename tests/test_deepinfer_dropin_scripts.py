"""DeepInfer scripts run unchanged on the drop-in (deepinfer.entrypoints.llm.LLM): its tokenizer type, DSpark by
default with its environment variables, per-token outputs, a failed request failing alone, its inert engine
arguments and its 64-bit seed mask. DeepInfer 0.1.0's own entrypoints/llm.py and sampling_params.py are the
reference for each behaviour."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, os
from deepinfer.entrypoints.llm import LLM
from deepinfer.sampling_params import SamplingParams

llm = LLM(model="tiny", seed=0, max_num_seqs=4, disable_log_stats=True, served_model_name="my-model")
tok = llm.get_tokenizer()
prompt_ids = tok.encode("def fibonacci(n):")
good = SamplingParams(temperature=0.0, max_tokens=6)
bad = SamplingParams(temperature=0.0, max_tokens=6, so_args={"schema_type": "json", "schema": "{not json"})
texts = llm.generate(["def f(", "import os", "x = "], [good, bad, good])
llm.decode_sequence = False
[tokens] = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=SamplingParams(
    temperature=0.0, max_tokens=4, seq_seed=-abs(hash("a request")) - 1))
decoding = llm._llm.settings.decoding
print(json.dumps({"ids_are_a_list": isinstance(prompt_ids, list) and all(isinstance(t, int) for t in prompt_ids),
                  "eos": tok.eos_token_id, "texts": texts, "per_token": [t.token_id for t in tokens],
                  "last_finished": tokens[-1].finished, "decoding": [decoding.name, decoding.num_draft_tokens,
                                                                      decoding.varlen]}))
llm.close()
'''


@pytest.mark.timeout(300)
def test_a_deepinfer_script_with_its_dspark_variables_runs_unchanged(tmp_path):
    script = tmp_path / "deepinfer_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ids_are_a_list"] and out["eos"] == 1  # the embedded model's <｜end▁of▁sentence｜>
    assert out["texts"][1] == "" and out["texts"][0] and out["texts"][2]  # the bad schema failed alone
    assert len(out["per_token"]) == 4 and out["last_finished"]
    assert out["decoding"] == ["dspark", 3, True]  # DSpark by default: the embedded model has draft layers
    err = done.stderr
    assert "request 1 failed: grammar compilation failed" in err
    assert "LLM(disable_log_stats=True) has no effect here: in DeepInfer it" in err
    assert "LLM(served_model_name='my-model') has no effect here" in err
    assert "DEEPINFER_USE_NEXTN_DECODE is set but ignored" not in err  # honoured, not warned about


@pytest.fixture(scope="module")
def tiny():
    from deepinfer.entrypoints.llm import LLM

    with LLM("tiny", process="inproc", max_num_seqs=4) as llm:
        yield llm


def test_get_tokenizer_is_a_transformers_fast_tokenizer_over_ours(tiny):
    transformers = pytest.importorskip("transformers")
    tok = tiny.get_tokenizer()
    ours = tiny._llm.program.tokenize.tokenizer
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    text = "def f(x):\n    return x"
    assert tok.encode(text) == ours.encode(text).ids and tok.decode(tok.encode(text)) == ours.decode(
        ours.encode(text).ids, skip_special_tokens=False)
    assert tok.eos_token_id == tiny._llm._engine.info.eos_token_id and tok.bos_token_id == tok.encode("x")[0]
    assert tiny.get_tokenizer() is tok  # built once


def test_dspark_is_the_default_with_draft_layers_and_drafts_follow_the_variable(tiny, monkeypatch):
    d = tiny._llm.settings.decoding
    assert (d.name, d.num_draft_tokens) == ("dspark", int(os.environ.get("DEEPINFER_USE_NEXTN_DECODE", 5)))
    from deepinfer.entrypoints.llm import LLM

    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")  # DeepInfer's way to turn drafting off
    with LLM("tiny", process="inproc", max_num_seqs=4) as off:
        assert (off._llm.settings.decoding.name, off._llm.settings.decoding.num_draft_tokens) == ("dspark", 0)
    with LLM("tiny", process="inproc", max_num_seqs=4, overrides=["decoding=plain"]) as plain:
        assert plain._llm.settings.decoding.name == "plain"  # an explicit choice wins


def test_a_failed_request_is_an_empty_string_and_one_logged_line(tiny, caplog):
    from deepinfer.sampling_params import SamplingParams

    bad = SamplingParams(max_tokens=4, so_args={"schema_type": "regex", "schema": "(unclosed"})
    with caplog.at_level(logging.ERROR, logger="deepinfer"):
        texts = tiny.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=4), bad], use_tqdm=False)
    assert texts[0] and texts[1] == ""
    failed = [r for r in caplog.records if r.getMessage().startswith("request 1 failed")]
    assert len(failed) == 1 and "\n" not in failed[0].getMessage()


def test_inert_engine_arguments_are_accepted_with_one_warning_each(caplog):
    from deepinfer.entrypoints.llm import INERT, _warn_inert

    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        _warn_inert({"tokens_per_block": 64, "stop_preempted_request": False})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"LLM(tokens_per_block=64) has no effect here: in DeepInfer it {INERT['tokens_per_block']}",
                     "LLM(stop_preempted_request=False) has no effect here: in DeepInfer it "
                     f"{INERT['stop_preempted_request']}"]


def test_seq_seed_is_masked_to_64_bits_as_deepinfer_does():
    from deepinfer.sampling_params import SamplingParams

    assert SamplingParams(seq_seed=-1).seq_seed == 2**64 - 1
    assert SamplingParams(seq_seed=2**64 + 5).seq_seed == 5
    assert SamplingParams(seq_seed=7).seq_seed == 7 and SamplingParams().seq_seed is None
