"""What one client may cost the server: the body's size (413 before it is read in full or parsed), the time its head
and body may take (a slow or silent sender is cut off), how many connections it may hold (503 beyond the cap), the
prompt's length (refused before it is tokenized); and the web checks: JSON only (415), allowed Host names, allowed
Origins with CORS. Waits are for conditions with generous deadlines; counters in /metrics say what happened."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serving_helpers import MODEL, ThreadServer, wait_for

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
LIMIT = 4096


@pytest.fixture(scope="module")
def server():
    srv = ThreadServer([f"serve.max_body_bytes={LIMIT}", "serve.header_timeout=1", "serve.body_timeout=1",
                        "serve.max_connections=6", "serve.allowed_origins=[http://app.example]",
                        "engine.max_model_len=64"])  # 64 tokens of at most 33 characters: 2112 < LIMIT
    yield srv
    srv.close()


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(f"deepinfer_{name}{{")))


def _raw(server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


# ---- the body ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_body_over_the_limit_by_content_length_is_413_naming_it_before_it_is_read(server):
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 * LIMIT}\r\n\r\n").encode()
    sock = _raw(server, head)  # not one byte of the body is sent: the answer cannot have waited for it
    reply = _read_all(sock).decode()
    assert reply.startswith("HTTP/1.1 413") and "connection: close" in reply.lower()
    error = json.loads(reply.split("\r\n\r\n", 1)[1])["error"]
    assert f"at most {LIMIT} bytes (serve.max_body_bytes)" in error["message"] and error["code"] == "request_too_large"


@pytest.mark.timeout(60)
def test_a_chunked_body_is_cut_off_at_the_limit_while_it_streams_in(server):
    before = _metric(server, "bodies_too_large_total")
    head = (b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 1024
    sock = _raw(server, head + b"".join(b"400\r\n" + chunk + b"\r\n" for _ in range(LIMIT // 1024 + 1)))
    reply = _read_all(sock).decode()  # the body never ends: only the limit can answer
    assert reply.startswith("HTTP/1.1 413")
    assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["type"] == "request_too_large"  # Anthropic's shape
    assert _metric(server, "bodies_too_large_total") == before + 1


@pytest.mark.timeout(60)
def test_a_body_that_does_not_arrive_in_time_is_408_and_the_connection_closed(server):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"model\":")
    reply = _read_all(_raw(server, head)).decode()
    assert reply.startswith("HTTP/1.1 408") and "serve.body_timeout" in reply


@pytest.mark.timeout(60)
def test_a_slow_sender_of_headers_is_cut_off(server):
    before = _metric(server, "header_timeouts_total")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sent, deadline = 0, time.monotonic() + 30
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
    try:
        while time.monotonic() < deadline:  # 5 bytes at a time, a trickle that never completes the head
            sock.sendall(head[sent:sent + 5])
            sent += 5
            time.sleep(0.2)  # the sender's own rate (5 B per 0.2 s), not a wait for the server
    except OSError:
        pass  # reset or broken pipe: cut off
    else:
        assert sock.recv(1) == b"", "the slow sender was never cut off"
    assert sent < len(head) and _metric(server, "header_timeouts_total") >= before + 1


@pytest.mark.timeout(60)
def test_a_silent_connection_is_closed(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    assert sock.recv(1) == b""  # closed by the server after serve.header_timeout, with nothing sent


@pytest.mark.timeout(60)
def test_connections_beyond_the_cap_get_503_and_the_server_serves_again_after(server):
    before = _metric(server, "connections_refused_total")
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(6)]
    extra = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    reply = _read_all(extra).decode()
    assert reply.startswith("HTTP/1.1 503") and "serve.max_connections" in reply
    for s in held:
        s.close()
    assert wait_for(lambda: httpx.get(f"{server.url}/health", timeout=30).status_code == 200)
    assert _metric(server, "connections_refused_total") >= before + 1



@pytest.mark.timeout(60)
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server):
    conv = server.state.converter
    limit = conv.max_model_len * conv.longest_token
    calls = []
    encode = conv.tokenizer.encode
    conv.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    try:
        huge = "a" * (limit + 1)
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": huge}),
                           ("/tokenize", {"model": MODEL, "prompt": huge})):
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 400 and f"at most {limit} characters" in r.json()["error"]["message"], path
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={**CHAT, "messages": [{"role": "user", "content": huge}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        conv.tokenizer.encode = encode
    assert calls == []


# ---- the web ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_json_endpoints_take_only_application_json(server, kind):
    headers = {"content-type": kind} if kind else {}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"):
        r = httpx.post(server.url + path, content=json.dumps(CHAT), headers=headers, timeout=30)
        assert r.status_code == 415, (path, r.status_code)
        assert "allowed: application/json" in r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(CHAT), timeout=60,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.timeout(60)
def test_a_foreign_host_header_is_refused_on_a_loopback_server(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"host": "evil.example"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    assert "serve.allowed_hosts" in r.json()["error"]["message"]
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert httpx.get(f"{server.url}/health", headers={"host": host}, timeout=30).status_code == 200, host


@pytest.mark.timeout(60)
def test_origins_not_listed_are_refused_and_a_listed_one_gets_cors(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"origin": "http://evil.example"},
                   timeout=30)
    assert r.status_code == 403 and "serve.allowed_origins" in r.json()["error"]["message"]
    pre = httpx.options(f"{server.url}/v1/chat/completions", timeout=30, headers={
        "origin": "http://app.example", "access-control-request-method": "POST",
        "access-control-request-headers": "content-type, authorization"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"origin": "http://app.example"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"


# ---- the settings ----------------------------------------------------------------------------------------------
def test_the_limits_are_validated_and_conf_serve_states_the_schemas_defaults():
    import dataclasses
    from importlib import resources

    import yaml

    from deepinfer.api import load_settings
    from deepinfer.config.errors import ConfigError
    from deepinfer.config.schema import ServeSettings
    from deepinfer.serving.connections import connection_cap

    for bad, words in (("serve.max_body_bytes=10", "serve.max_body_bytes=10 is out of range; allowed: an integer in"),
                       ("serve.header_timeout=0", "serve.header_timeout=0"),
                       ("serve.max_connections=0", "serve.max_connections=0 is out of range")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
            load_settings(["serve=openai", bad])
    with pytest.raises(ConfigError, match=r"serve.max_connections=2000 is out of range; allowed: below the open-file"):
        connection_cap(2000, 1024)
    assert connection_cap(None, 1024) == 768 and connection_cap(None, 1 << 20) == 16384
    stated = yaml.safe_load((resources.files("deepinfer.conf") / "serve" / "openai.yaml").read_text())
    for f in dataclasses.fields(ServeSettings):
        if f.name in stated and f.name not in ("name", "api_key"):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert stated[f.name] == (list(default) if isinstance(default, tuple) else default), f.name


# ---- memory after a large body ---------------------------------------------------------------------------------
def _run_guard(body: bytes) -> None:
    import asyncio

    from fastapi.responses import JSONResponse

    from deepinfer.serving.guard import Guard, GuardSettings

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await JSONResponse({})(scope, receive, send)

    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)]
    messages = [{"type": "http.request", "body": c, "more_body": i + 1 < len(chunks)} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]}
    guard = Guard(app, GuardSettings(max_body_bytes=1 << 22, body_timeout=30, allowed_hosts=None, allowed_origins=()))
    asyncio.run(guard(scope, receive, send))


def test_a_large_body_asks_for_a_heap_trim_once_answered_and_a_small_one_does_not():
    """A large schema's parse leaves freed pages that glibc keeps; the server gives them back after answering."""
    from deepinfer.sampling import heap_trim
    from deepinfer.serving.guard import TRIM_AFTER_BODY_BYTES

    before = heap_trim.requested
    _run_guard(b"{" + b" " * 1000 + b"}")
    assert heap_trim.requested == before
    _run_guard(b"{" + b" " * TRIM_AFTER_BODY_BYTES + b"}")
    assert heap_trim.requested == before + 1
