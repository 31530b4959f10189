"""The routes that read the tokenizer and the renderer without running the model (vLLM's /tokenize, /detokenize,
/version), and OpenAI's include_usage rule for streamed usage."""

from __future__ import annotations

import json

import httpx
import pytest
from serving_helpers import MODEL

HELLO = [{"role": "user", "content": "Hello"}]


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.timeout(60)
def test_tokenize_a_prompt_in_vllms_shape(server):
    out = post(server, "/tokenize", {"model": MODEL, "prompt": "def f(x):", "return_token_strs": True}).json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 8192
    bare = post(server, "/tokenize", {"prompt": "def f(x):", "add_special_tokens": False}).json()
    assert bare["tokens"] == out["tokens"][1:] and bare["token_strs"] is None  # no beginning-of-sequence token


@pytest.mark.timeout(60)
def test_detokenize_inverts_tokenize(server):
    ids = post(server, "/tokenize", {"prompt": "import os", "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": "import os"}


@pytest.mark.timeout(120)
def test_tokenized_messages_count_what_a_chat_request_reports(server):
    counted = post(server, "/tokenize", {"messages": HELLO}).json()["count"]
    chat = post(server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 1}).json()
    assert counted == chat["usage"]["prompt_tokens"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": HELLO}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_token_requests_are_one_line_400s_naming_the_field(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "\n" not in r.json()["error"]["message"]


@pytest.mark.timeout(60)
def test_an_unknown_model_is_404_on_the_token_routes_too(server):
    r = post(server, "/tokenize", {"model": "gpt-4o", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.timeout(60)
def test_version(server):
    assert isinstance(httpx.get(server.url + "/version").json()["version"], str)


# ---- include_usage ---------------------------------------------------------------------------------------------
def _stream(server, path, body) -> list[dict]:
    r = post(server, path, {**body, "stream": True})
    events = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 3}),
    ("/v1/completions", {"prompt": "def f(", "max_tokens": 3}),
])
def test_streamed_usage_comes_only_with_include_usage_in_a_chunk_of_its_own(server, path, body):
    plain = _stream(server, path, body)
    assert all("usage" not in c for c in plain)
    asked = _stream(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in asked[:-1]) and asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == 3


# ---- metrics ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_metrics_carry_the_model_name_and_per_request_histograms(server):
    post(server, "/v1/completions", {"prompt": "def f(", "max_tokens": 4, "ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    label = f'model_name="{MODEL}"'
    for name in ("deepinfer_e2e_request_latency_seconds_count", "deepinfer_request_queue_time_seconds_count",
                 "deepinfer_request_prompt_tokens_count", "deepinfer_request_generation_tokens_count",
                 "deepinfer_requests_total", "deepinfer_spec_decode_num_draft_tokens_total"):
        line = next((ln for ln in text.splitlines() if ln.startswith(name + "{")), None)
        assert line is not None and label in line, name
    for name in ("deepinfer_e2e_request_latency_seconds_count", "deepinfer_request_generation_tokens_count"):
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        assert float(line.split()[-1]) >= 1, line
