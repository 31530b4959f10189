"""Faults of the engine-core process and hostile requests (issue 11): every fault is reported by the deadline
that names it, close() never hangs (it reaps the core), and one bad request ends alone while the engine keeps
serving. Wall-clock bounds here only catch a hang: they are far above the quiet-machine times."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import signal
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from deepinfer.engine import EngineDeadError
from deepinfer.frontend import LLMEngine
from deepinfer.engine.ipc import PrivateEndpoints
from deepinfer.engine.messages import AddRequest
from deepinfer.sampling import SamplingParams
from options_helpers import settings_for

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")
PROMPT = [0, 5, 6, 7]


def engine(process="subprocess", **kw) -> LLMEngine:
    return LLMEngine.for_settings(settings_for(MODEL, process=process, memory_budget=1 << 22), **kw)


def greedy(n=4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


HANG_S = 60  # far above any quiet-machine time below (a deadline of 2-3 s, a close of under 2 s)


def timed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except EngineDeadError as exc:
        return time.monotonic() - t0, exc
    return time.monotonic() - t0, None


def silent_seconds(exc) -> int:
    """The silence the client measured when it gave up ("... sent no heartbeat for N s ...")."""
    return int(re.search(r"for (\d+) s \(deadline", str(exc)).group(1))


def test_a_core_killed_while_idle_makes_the_next_generate_raise_and_close_reap_it():
    eng = engine()
    try:
        eng.generate([PROMPT], greedy(), use_tqdm=False)
        os.kill(eng.client.process.pid, signal.SIGKILL)
        eng.client.process.wait(timeout=HANG_S)  # dead between two calls
        took, exc = timed(lambda: eng.generate([PROMPT], greedy(), use_tqdm=False))
        assert exc is not None and took < HANG_S
        assert "exited with code -9" in str(exc)
    finally:
        took, _ = timed(eng.close)
    assert took < HANG_S


def test_a_stopped_core_is_reported_by_its_heartbeat_deadline_and_close_kills_it():
    eng = engine(heartbeat_timeout_s=3.0)
    pid = eng.client.process.pid
    try:
        eng.generate([PROMPT], greedy(), use_tqdm=False)
        os.kill(pid, signal.SIGSTOP)  # alive to the OS, silent to us: the case a pid check cannot see
        took, exc = timed(lambda: eng.generate([PROMPT], greedy(64), use_tqdm=False))
        assert exc is not None and took < HANG_S
        assert "no heartbeat" in str(exc) and "(deadline 3 s): it is stopped or hung" in str(exc)
        assert silent_seconds(exc) >= 3, "never declared dead before its deadline"
    finally:
        took, _ = timed(eng.close)
        if eng.client.process.poll() is None:  # never leave a stopped process behind, even when failing
            os.kill(pid, signal.SIGKILL)
    assert took < HANG_S
    assert eng.client.process.poll() is not None


def test_a_stopped_core_is_reported_even_while_generate_is_waiting_for_tokens():
    eng = engine(heartbeat_timeout_s=2.0)
    pid = eng.client.process.pid

    def stop_on_first_token(index, token_ids):
        os.kill(pid, signal.SIGSTOP)

    try:
        took, exc = timed(lambda: eng.generate([PROMPT] * 2, greedy(200), use_tqdm=False,
                                               on_update=stop_on_first_token))
        assert exc is not None and took < HANG_S
        assert "(deadline 2 s): it is stopped or hung" in str(exc) and silent_seconds(exc) >= 2
    finally:
        eng.close()
        if eng.client.process.poll() is None:
            os.kill(pid, signal.SIGKILL)


STALLING_CORE = '''
    """sitecustomize of the engine-core process: the real model, except that every forward blocks for an hour (a step
    loop stuck in a call that never returns, while the rest of the process, its heartbeat thread, runs on)."""
    import time

    from deepinfer.engine.backend import SettingsBackend

    load = SettingsBackend.__call__


    def stalling(self):
        backend = load(self)

        def stall(batch):
            time.sleep(3600)

        backend.prefill = backend.decode = stall
        return backend


    SettingsBackend.__call__ = stalling
'''


def test_a_step_loop_stuck_while_the_heartbeat_runs_is_reported_by_the_step_deadline(monkeypatch, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(STALLING_CORE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    eng = engine(step_timeout_s=2.0)
    try:
        took, exc = timed(lambda: eng.generate([PROMPT], greedy(), use_tqdm=False))
        assert exc is not None and took < HANG_S
        assert "step loop" in str(exc) and "(deadline 2 s): it is hung" in str(exc)
    finally:
        took, _ = timed(eng.close)
    assert took < HANG_S


@pytest.mark.parametrize("field, value", [("max_tokens", None), ("max_tokens", "8"), ("max_tokens", -5),
                                          ("temperature", float("nan")), ("top_p", 2.0)])
def test_a_params_field_changed_after_construction_errors_only_its_request(field, value):
    """The frontend checks again; behind it the core checks too (below), so neither can be bypassed."""
    bad = greedy()
    setattr(bad, field, value)
    with engine(process="inproc") as eng:
        outs = eng.generate([PROMPT] * 3, [greedy(), bad, greedy()], use_tqdm=False)
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert f"SamplingParams.{field}=" in outs[1].error and "\n" not in outs[1].error
        assert eng.generate([PROMPT], greedy(), use_tqdm=False)[0].finish_reason == "length"


def test_the_engine_core_rejects_a_malformed_request_that_skipped_the_frontend_and_keeps_serving():
    bad = greedy()
    bad.max_tokens = None
    with engine() as eng:
        good_before = eng.generate([PROMPT], greedy(), use_tqdm=False)[0].token_ids
        eng.client.add([AddRequest(10_000, PROMPT, bad, 1), AddRequest(10_001, [1, "x"], greedy(), 1),
                        AddRequest(10_002, PROMPT, "not params", 1)])
        errors = {}
        deadline = time.monotonic() + HANG_S
        while len(errors) < 3 and time.monotonic() < deadline:
            out = eng.client.get(timeout=0.5)
            for upd in out.updates if out else []:
                errors[upd.request_id] = (upd.finish_reason, upd.error)
        assert errors[10_000][0] == "error" and "SamplingParams.max_tokens=None" in errors[10_000][1]
        assert errors[10_001] == ("error", "prompt token ids must be a list of integers")
        assert errors[10_002] == ("error", "sampling params must be a SamplingParams; got str")
        assert eng.generate([PROMPT], greedy(), use_tqdm=False)[0].token_ids == good_before


class _Payload:
    """What an attacker would send: unpickling it writes a marker file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def test_a_peer_without_the_key_is_ignored_and_reads_nothing(tmp_path, monkeypatch):
    """Keep the socket paths (normally removed once the core is up) so a same-user process can connect: its
    pickles are dropped unread, and frontend->core traffic never reaches it."""
    monkeypatch.setattr(PrivateEndpoints, "remove", lambda self: None)
    marker = tmp_path / "marker"
    eng = engine()
    endpoints = eng.client._endpoints
    ctx = zmq.Context()
    spy, beat = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    try:
        for sock in (spy, beat):
            sock.setsockopt(zmq.LINGER, 0)
        spy.connect(endpoints.control)
        beat.connect(endpoints.heartbeat)
        evil = pickle.dumps(("outputs", _Payload(marker)))
        for _ in range(3):
            spy.send(b"\0" * 40 + evil)
            beat.send(b"\0" * 40 + pickle.dumps(("heartbeat", _Payload(marker))))
        outs = eng.generate([PROMPT] * 2, greedy(), use_tqdm=False)
        assert [o.finish_reason for o in outs] == ["length", "length"]
        deadline = time.monotonic() + HANG_S  # the frames may still be on their way: wait until they are read
        while eng.client.dropped_frames < 3 and time.monotonic() < deadline:
            eng.client.get(timeout=0.1)
        assert eng.client.dropped_frames >= 3
        assert not marker.exists()
        assert spy.poll(500) == 0  # the frontend routes only to the core's own connection
    finally:
        spy.close()
        beat.close()
        ctx.term()
        eng.close()
        shutil.rmtree(endpoints.dir, ignore_errors=True)


def test_llm_answers_a_malformed_prompt_alone_and_takes_the_heartbeat_deadline_from_the_config():
    from deepinfer import LLM

    with LLM(process="inproc", engine={"heartbeat_timeout": 7}) as llm:
        assert llm._engine.options.heartbeat_timeout_s == 7
        outs = llm.generate([{"prompt_token_ids": 5}, {"prompt_token_ids": [0, 5, 6]}],
                            SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert outs[0].finish_reason == "error" and outs[0].error == "prompt_token_ids=5 is not a list of token ids"
    assert outs[1].finish_reason == "length"


def test_a_frame_is_accepted_only_with_the_key_the_senders_label_and_a_new_sequence_number():
    from deepinfer.engine.ipc import CORE, FRONTEND, Signer, Verifier, new_key
    from deepinfer.engine.messages import TO_CORE, Abort

    key = new_key()
    core_in = Verifier(key, FRONTEND, TO_CORE)
    frame = Signer(key, FRONTEND).pack(Abort([1]))
    assert core_in.unpack(frame) == Abort([1])
    assert core_in.unpack(frame) is None  # replayed
    assert core_in.unpack(Signer(new_key(), FRONTEND).pack(Abort([2]))) is None  # another key
    assert core_in.unpack(Signer(key, CORE).pack(Abort([3]))) is None  # the core's own message reflected back
    assert core_in.unpack(b"short") is None
    assert core_in.rejected == 4
