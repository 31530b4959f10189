"""The server's lifecycle and safety: the API key, the port checked before the model loads, the drain on SIGTERM
(new requests 503, open streams end with an error event and [DONE], exit 0, no traceback)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from serving_helpers import MODEL, ThreadServer, openai_client

from deepinfer.api import load_settings
from deepinfer.serving.auth import exposure_warning

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LONG_STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8000,
               "ignore_eos": True, "stream": True}  # minutes of tokens on a CPU: still open when the server stops


# ---- the API key ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed():
    srv = ThreadServer(["serve.api_key=s3cret"])
    yield srv
    srv.close()


@pytest.mark.timeout(120)
def test_without_the_key_every_v1_route_is_401_in_the_protocols_shape(keyed):
    r = httpx.post(f"{keyed.url}/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{keyed.url}/v1/messages", json={**CHAT, "max_tokens": 2}, timeout=30,
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": "the API key is not valid for this server"}}
    assert httpx.get(f"{keyed.url}/v1/models", timeout=30).status_code == 401
    assert httpx.post(f"{keyed.url}/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401


@pytest.mark.timeout(120)
def test_with_the_key_as_bearer_or_x_api_key_requests_are_served(keyed):
    openai = pytest.importorskip("openai")
    client = openai_client(keyed)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(**CHAT)  # openai_client sends the key "none"
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="s3cret", max_retries=0, timeout=60)
    assert client.chat.completions.create(**CHAT).usage.completion_tokens == 2
    r = httpx.post(f"{keyed.url}/v1/messages", json=CHAT, headers={"x-api-key": "s3cret"}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2


@pytest.mark.timeout(60)
def test_probes_stay_open_with_a_key(keyed):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(keyed.url + path, timeout=30).status_code == 200, path


def test_the_key_comes_from_DEEPINFER_API_KEY(monkeypatch):
    monkeypatch.setenv("DEEPINFER_API_KEY", "from-env")
    assert load_settings(["serve=openai"]).serve.api_key == "from-env"
    assert load_settings(["serve=openai", "serve.api_key=from-cli"]).serve.api_key == "from-cli"


def test_binding_beyond_loopback_without_a_key_warns():
    assert "without an API key" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("0.0.0.0", "k") is None
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None


# ---- draining --------------------------------------------------------------------------------------------
def _events(lines) -> list[str]:
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]


@pytest.mark.timeout(180)
def test_a_drain_refuses_new_requests_and_ends_open_streams_with_an_error_and_done():
    srv = ThreadServer()
    drain = srv.state.drain
    drain.timeout = 600  # the test expires it itself
    try:
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=LONG_STREAM, timeout=120) as stream:
            lines = stream.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[len("data: "):])["choices"]
            srv.call(drain.begin)
            refused = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=30)
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            srv.call(drain.expire)
            rest = _events(lines)
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        assert srv.idle(), "the aborted request still holds cache"
    finally:
        srv.close()


# ---- the command ---------------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_line_and_exit_2_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # a model path that does not exist: had it been loaded first, the error would name it
        out = subprocess.run([sys.executable, "-m", "deepinfer", "serve=openai", f"serve.port={port}",
                              "model.path=/nonexistent/model", f"hydra.run.dir={tmp_path}"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=100)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "already in use" in lines[0] and f"serve.port={port}" in lines[0], out.stderr


@pytest.mark.timeout(180)
def test_sigterm_drains_open_streams_then_exits_cleanly(tmp_path):
    cmd = [sys.executable, "-m", "deepinfer", "serve=openai", "serve.port=0", "engine.max_num_seqs=4",
           "serve.shutdown_timeout=1", "cache.memory_budget=67108864", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ})
    try:
        port = None
        for line in proc.stderr:
            if "serving" in line:
                port = int(line.rsplit(":", 1)[1])
                break
        assert port, "the server did not announce its address"
        engine_pids = _children(proc.pid)
        assert engine_pids, "no engine-core process"
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.stream("POST", url, json=LONG_STREAM, timeout=120) as stream:
            lines = stream.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))  # the stream is open
            proc.send_signal(signal.SIGTERM)
            rest = _events(lines)
        assert rest[-1] == "[DONE]" and "shutting down" in json.loads(rest[-2])["error"]["message"]
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "server stopped" in err and "Traceback" not in err, err
        for pid in engine_pids:
            assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
