"""`python -m deepinfer` under bad input and faults (issue 11): one line on stderr and exit code 2 for every user
error, found before any work; a dead engine core is one line too; Ctrl-C keeps what finished and exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.config.errors import ConfigError


def cli(args, cwd, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "deepinfer", *args], cwd=cwd, capture_output=True, timeout=timeout)
    return proc.returncode, proc.stderr.decode(errors="replace")


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("deepinfer: error: "), stderr
    return lines[0]


@pytest.fixture
def inputs(tmp_path):
    def write(name: str, content: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(content)
        return str(path)

    return write


# Each case: overrides -> what the one line must say. Config checks cost no model load.
CONFIG_CASES = [
    (["engine.max_model_len=1"], "engine.max_model_len=1 is out of range; allowed: an integer in [2,"),
    (["cache.memory_budget=1"], "cache.memory_budget=1 is out of range"),
    (["cache.memory_budget=100000000000000"], "allowed: at most the cpu device's memory"),
    (["cache.memory_budget=1e14"], "cache.memory_budget=1e14 has the wrong type"),
    (["cache.block_size=1e9"], "cache.block_size=1e9 has the wrong type"),
    (["cache.block_size=1000000000"], "cache.block_size=1000000000 is out of range; allowed: an integer in [8, 8192]"),
    (["cache.block_size=1"], "cache.block_size=1 is out of range"),
    (["engine.max_num_seqs=10000000"], "engine.max_num_seqs=10000000 is out of range"),
    (["prompts=[]"], "prompts=[] is empty"),
    (["hydra.run.dir=/proc/deepinfer-nope"], "hydra.run.dir='/proc/deepinfer-nope' is not a writable directory"),
    (["output_file=/proc/deepinfer-x/out.jsonl"], "is not a writable directory"),
]


def main_in_process(args, cwd, monkeypatch, capsys):
    """The CLI's entry point in this process (no interpreter start-up): these errors come before Hydra runs."""
    from deepinfer.__main__ import main

    monkeypatch.chdir(cwd)
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", CONFIG_CASES, ids=[c[0][0] for c in CONFIG_CASES])
def test_a_bad_config_value_is_one_line_and_exit_2(overrides, message, tmp_path, monkeypatch, capsys):
    code, stderr = main_in_process(overrides, tmp_path, monkeypatch, capsys)
    assert code == 2
    assert message in one_error_line(stderr)


def test_a_cache_budget_beyond_the_machine_exits_2_from_the_cli_without_allocating(tmp_path):
    code, stderr = cli(["cache.memory_budget=100000000000000"], tmp_path)
    assert code == 2 and "cache.memory_budget=100000000000000 is out of range" in one_error_line(stderr)


INPUT_CASES = [
    (b'{"prompt_token_ids": 5}\n', "line 1: prompt_token_ids=5 is not a non-empty list of token ids"),
    (b"null\n", "line 1: NoneType is not a request"),
    (b'"fine"\n{"prompt": 7}\n', "line 2: prompt=7 is not a string"),
    (b'\xff\xfe{"prompt": "a"}\n', "line 1: not UTF-8 text"),
    (b"\n\n", "has no requests"),
]


@pytest.mark.parametrize("content, message", INPUT_CASES, ids=["ids-int", "null", "prompt-int", "non-utf8", "empty"])
def test_a_bad_input_line_is_one_line_and_exit_2_before_the_model_loads(content, message, inputs, tmp_path,
                                                                         monkeypatch, capsys):
    code, stderr = main_in_process([f"input_path={inputs('in.jsonl', content)}"], tmp_path, monkeypatch, capsys)
    assert code == 2
    assert message in one_error_line(stderr)


def test_read_requests_names_the_line_of_a_bad_request(inputs):
    from deepinfer.cli.requests import read_requests
    from deepinfer.config.schema import Settings

    settings = Settings(input_path=inputs("x.jsonl", b'{"prompt": "a"}\n{"prompt_token_ids": [1, true]}\n'))
    with pytest.raises(ConfigError, match="line 2: prompt_token_ids=\\[1, true\\]"):
        read_requests(settings)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def _start_long_run(tmp_path, inputs):
    """Five prompts that run for a long time, one that ends at once with an error (longer than max_model_len).
    Returns once the engine core is generating: its "engine ready" line is out and it has since computed for a
    while (so the run is inside generate, the error request finished)."""
    lines = [json.dumps({"prompt_token_ids": [0] * 300})] + [json.dumps({"prompt": f"p{i}"}) for i in range(5)]
    path = inputs("long.jsonl", ("\n".join(lines) + "\n").encode())
    args = [f"input_path={path}", "engine.max_model_len=4096", "sampling.max_tokens=4000",
            "sampling.ignore_eos=true", f"hydra.run.dir={tmp_path / 'run'}"]
    # faulthandler on: a CLI that does not end is sent SIGABRT by _ended, which then prints every thread's stack.
    # SIGINT back to its default in the CLI, as a terminal's foreground job has it: pytest started as a background
    # job of a script (`.ci/run &`) ignores SIGINT and SIGQUIT (POSIX, for asynchronous lists), an ignored signal
    # stays ignored across exec, and the CLI then rightly ignores Ctrl-C too (SigIgn 0x1001006 in its
    # /proc status when this test timed out so; never in the foreground)
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:  # a hang here is bounded by the test's timeout
        if b"engine ready" in line:
            break
    core = _children(proc.pid)
    assert core, f"the engine core never started: {proc.stderr.read() if proc.poll() is not None else ''}"
    ready = _cpu_seconds(core[0])
    deadline = time.monotonic() + 120  # only bounds a hang: a few generated tokens take well under a second
    while _cpu_seconds(core[0]) < ready + 0.5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cpu_seconds(core[0]) >= ready + 0.5, "the engine core never started generating"
    return proc, core[0]


def _ended(proc, timeout: float = 30.0) -> tuple[bytes, bytes]:
    """proc's output once it exits; past `timeout`, the test fails with the stacks of its threads (a fast-tier run
    under load once saw the Ctrl-C run not end within 30 s, with nothing to show why)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with open(f"/proc/{proc.pid}/status") as f:  # the CLI's signal masks: blocked, ignored, caught
            masks = " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
        proc.send_signal(signal.SIGABRT)
        _out, err = proc.communicate(timeout=30)
        pytest.fail(f"the CLI did not end within {timeout} s of the fault ({masks}); its threads at SIGABRT:\n"
                    f"{err.decode(errors='replace')[-8000:]}")


def test_ctrl_c_writes_the_finished_outputs_and_exits_130_with_one_line(tmp_path, inputs):
    proc, _core = _start_long_run(tmp_path, inputs)
    proc.send_signal(signal.SIGINT)
    _out, err = _ended(proc)
    assert proc.returncode == 130, err
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("deepinfer: interrupted"), err
    written = [json.loads(line) for line in (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()]
    assert [o["finish_reason"] for o in written] == ["error"]


def test_an_engine_core_that_dies_under_the_cli_is_one_line_and_exit_2(tmp_path, inputs):
    proc, core = _start_long_run(tmp_path, inputs)
    os.kill(core, signal.SIGKILL)
    _out, err = _ended(proc)
    assert proc.returncode == 2
    line = one_error_line(err.decode())
    assert f"the engine core process (pid {core}) exited with code -9" in line
