"""input_path JSONL lines carry per-request SamplingParams fields; an unknown field ends that line's request."""

import json
from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.cli.requests import generate_requests, read_requests

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")


@pytest.fixture(scope="module")
def llm():
    with LLM(model=MODEL, process="inproc", runtime={"num_threads": 1}, sampling={"temperature": 0}) as llm:
        yield llm


def test_jsonl_lines_carry_any_sampling_field_and_an_unknown_one_errors_only_its_line(llm, tmp_path):
    lines = [
        {"prompt": "def f(", "max_tokens": 3},
        {"prompt_token_ids": [0, 5, 6], "max_tokens": 2, "golden_token_ids": [7, 8], "logprobs": False},
        {"prompt": "x", "max_tokenz": 3},
        {"prompt": "x", "so_args": {"schema_type": "regex", "schema": "ab"}, "max_tokens": 5},
        {"prompt": "x", "top_p": 2.0},
        "plain text line",
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    settings = llm.settings.__class__(**{**llm.settings.__dict__, "input_path": str(path)})
    outs = generate_requests(llm, read_requests(settings))
    assert len(outs[0].token_ids) == 3 and outs[0].finish_reason == "length"
    assert outs[1].token_ids == [7, 8] and outs[1].logprobs is None
    assert outs[2].finish_reason == "error" and outs[2].error.startswith(
        "request 2: unknown SamplingParams field 'max_tokenz'; allowed: temperature,")
    assert outs[3].finish_reason == "stop" and outs[3].text == "ab"
    assert outs[4].error == "request 4: SamplingParams.top_p=2.0 is out of range; allowed: (0, 1]"
    assert len(outs[5].token_ids) == llm.settings.sampling.max_tokens  # the config's section, no line fields
    assert all("\n" not in (o.error or "") for o in outs)
    assert [o.request_id for o in outs] == list(range(len(lines)))  # request ids are input lines, failed ones too


def test_a_run_whose_every_request_failed_exits_1_in_one_line(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "x", "max_tokenz": 3}) for _ in range(2)))
    proc = subprocess.run([sys.executable, "-m", "deepinfer", f"model.path={MODEL}", f"input_path={path}",
                           "engine.process=inproc"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("deepinfer: error")]
    assert proc.returncode == 1, proc.stderr
    assert errors == [errors[0]] and "every request failed (2 of 2)" in errors[0]


def test_a_full_disk_is_one_line_naming_the_file_and_what_was_written():
    from deepinfer.cli.outputs import write_outputs
    from deepinfer.config.errors import ConfigError
    from deepinfer.outputs import error_output

    full = Path("/dev/full")  # every write fails with ENOSPC
    if not full.exists():
        pytest.skip("needs /dev/full (Linux)")
    with pytest.raises(ConfigError, match=r"output_file='/dev/full' could not be written .*; 0 of 2 outputs"):
        write_outputs(full, [error_output(i, "x", [1], "e") for i in range(2)])
