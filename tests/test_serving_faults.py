"""Faults the server must outlive or report: accept() out of file descriptors (EMFILE) never ends it; /health says
503 while the engine core is stopped and 200 again once it runs; a dead engine core ends the server with one line and
exit code 1 (serve.exit_on_engine_death), so a supervisor restarts it. Each runs `python -m deepinfer serve=openai`
as a user would; waits are for conditions, with generous deadlines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from serving_helpers import MODEL, wait_for

from deepinfer.frontend.async_engine import AsyncEngine


def _start(tmp_path, *overrides, shell_prefix: str = ""):
    args = [sys.executable, "-m", "deepinfer", "serve=openai", "serve.port=0", "cache.memory_budget=67108864",
            f"hydra.run.dir={tmp_path}", *overrides]
    cmd = ["bash", "-c", f"{shell_prefix}exec {' '.join(args)}"] if shell_prefix else args
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    for line in proc.stderr:
        if "serving" in line:
            return proc, f"http://127.0.0.1:{int(line.rsplit(':', 1)[1])}"
    raise AssertionError(f"the server did not start: {proc.stderr.read()[-2000:]}")


def _engine_pid(proc) -> int:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
    return int(out.split()[0])



def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(f"deepinfer_{name}{{")))


@pytest.mark.timeout(180)
def test_accept_out_of_file_descriptors_is_survived_and_counted(tmp_path):
    # a hard limit of 256 descriptors and a cap the descriptors run out before: accept() fails with EMFILE
    proc, url = _start(tmp_path, "serve.max_connections=250", "serve.header_timeout=3", shell_prefix="ulimit -n 256; ")
    held = []
    try:
        for _ in range(400):
            held.append(socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30))
        assert wait_for(lambda: proc.poll() is not None or len(held) == 400, 30)
        for s in held:
            s.close()
        held.clear()
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200)
        assert _metric(url, "accept_errors_total") >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_one_accept_failure_for_lack_of_descriptors_ends_the_accept_burst():
    """The stdlib selector loop (CPython before gh-151615) went on calling accept() up to `backlog` times after an
    EMFILE, each failure scheduling one more retry: ~25,000 failed accepts a second at 2,000 connections over a
    1024 open-file limit. With the server's loop guard one failure ends the burst, and so does the retry's."""
    import asyncio
    import errno

    from deepinfer.serving.connections import install_loop_guard
    from deepinfer.serving.metrics import ConnectionCounters

    class Exhausted:  # a listening socket of a process at its open-file limit
        def __init__(self):
            self.listening, self.calls = socket.socket(), 0

        def accept(self):
            self.calls += 1
            raise OSError(errno.EMFILE, "Too many open files")

        def fileno(self):
            return self.listening.fileno()

    loop, counters, sock = asyncio.SelectorEventLoop(), ConnectionCounters(), Exhausted()
    retries = []
    try:
        install_loop_guard(loop, counters)
        loop.call_later = lambda delay, fn, *args: retries.append((delay, fn, args))
        loop._accept_connection(lambda: None, sock, backlog=100)
        assert sock.calls == 1 and counters.counts["accept_errors"] == 1 and len(retries) == 1
        delay, start_serving, args = retries[0]
        assert delay >= 1.0  # the stdlib's pause before accepting again
        loop._accept_connection(*args[:2], backlog=100)  # the retry's burst, with the socket it was handed
        assert sock.calls == 2 and counters.counts["accept_errors"] == 2 and len(retries) == 2
    finally:
        sock.listening.close()
        loop.close()


@pytest.mark.timeout(240)
def test_health_reports_a_stopped_core_and_a_dead_core_ends_the_server_with_one_line(tmp_path):
    proc, url = _start(tmp_path, "serve.keep_alive_timeout=10")  # the refusals before the exit: 10 s of them
    try:
        core = _engine_pid(proc)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        os.kill(core, signal.SIGSTOP)
        stopped = time.monotonic()
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503)
        noticed = time.monotonic() - stopped
        error = httpx.get(f"{url}/health", timeout=10).json()["error"]
        assert "heartbeat" in error and "stopped or hung" in error, error
        os.kill(core, signal.SIGCONT)
        assert wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200)
        # a request waiting in the engine when the core dies: a 503 (the server is unavailable), not a 400 or 500
        os.kill(core, signal.SIGSTOP)
        answer = {}
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
        waiting = threading.Thread(target=lambda: answer.update(r=httpx.post(f"{url}/v1/chat/completions", json=body,
                                                                             timeout=120)))
        waiting.start()
        assert wait_for(lambda: _metric(url, "requests_waiting") == 1)
        os.kill(core, signal.SIGKILL)
        waiting.join(120)
        assert answer["r"].status_code == 503, answer["r"].text
        assert answer["r"].json()["error"]["message"].startswith("the engine is not serving: ")
        # until it stops, the server answers 503 and closes each connection after its answer, so no kept-alive
        # connection is closed under a request as it exits
        with httpx.Client(timeout=30) as client:
            late = client.post(f"{url}/v1/chat/completions", json=body)
        assert late.status_code == 503 and late.headers.get("connection") == "close", (late.status_code, late.headers)
        assert proc.wait(timeout=120) == 1
        err = proc.stderr.read()
        assert "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("deepinfer: error: the engine stopped (") and "exit_on_engine_death" in last, err
        assert f"pid {core}" in last and "-9" in last
        print(f"/health 503 {noticed:.1f} s after SIGSTOP")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _engine(age: float | None, dead: str | None = None) -> AsyncEngine:
    engine = AsyncEngine.__new__(AsyncEngine)  # health() reads only these
    engine.dead = dead
    engine.client = SimpleNamespace(heartbeat_age=lambda: age, options=SimpleNamespace(heartbeat_interval_s=0.5))
    return engine


def test_health_is_late_after_four_heartbeat_intervals_and_at_least_a_second():
    assert _engine(0.3).health() is None and _engine(None).health() is None
    assert _engine(1.9).health() is None
    assert "heartbeat is 2.5 s old (late after 2 s)" in _engine(2.5).health()
    assert _engine(0.1, dead="the engine core process exited").health() == "the engine core process exited"
