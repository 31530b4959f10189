"""The HTTP server on the embedded model, through the official `openai` and `anthropic` clients over loopback.

The model has random weights: what it writes is noise, so the tests check what the server guarantees whatever the
model writes: protocol shapes, streaming equal to non-streaming (greedy), grammars honoured (valid JSON, tool calls
that parse and satisfy their schema), one-line 4xx errors, aborts that free the cache.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from serving_helpers import MODEL, ThreadServer, openai_client

openai = pytest.importorskip("openai")

NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture()
def client(server):  # server: tests/conftest.py's, one per module
    return openai_client(server, timeout=60)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], **kw)


@pytest.mark.timeout(60)
def test_health_models_and_metrics(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat(client, max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("deepinfer_requests_waiting", "deepinfer_requests_running", "deepinfer_generation_tokens_per_second",
                 "deepinfer_time_to_first_token_seconds_bucket", "deepinfer_inter_token_latency_seconds_bucket",
                 "deepinfer_cache_utilization", "deepinfer_preemptions_total", "deepinfer_generation_tokens_total"):
        assert name in text, name
    generated = [ln for ln in text.splitlines() if ln.startswith("deepinfer_generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 3


@pytest.mark.timeout(120)
def test_chat_streaming_equals_non_streaming_and_ends_with_usage(client):
    full = chat(client, max_tokens=12, temperature=0, extra_body=NO_THINKING)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
    chunks = list(chat(client, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True},
                       extra_body=NO_THINKING))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content  # greedy: the same tokens, however they were chunked
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.timeout(120)
def test_chat_thinking_puts_text_in_reasoning_content(client):
    thinking = {"thinking": {"type": "enabled"}}  # off by default for the embedded model (serve.default_thinking)
    out = chat(client, max_tokens=6, seed=7, extra_body=thinking)  # the model is still reasoning at 6 tokens
    msg = out.choices[0].message
    assert msg.content == "" and msg.model_extra.get("reasoning_content")
    again = chat(client, max_tokens=6, seed=7, extra_body=thinking)  # OpenAI's seed is the request's seq_seed
    assert again.choices[0].message.model_extra["reasoning_content"] == msg.model_extra["reasoning_content"]


@pytest.mark.timeout(120)
def test_completions_streaming_and_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="def f(", max_tokens=10, temperature=0)
    assert full.object == "text_completion" and full.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=MODEL, prompt="def f(", max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


@pytest.mark.timeout(120)
def test_completions_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="import os", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[4:6]
    assert stop.strip(), "the greedy text should have printable characters to stop on"
    cut = client.completions.create(model=MODEL, prompt="import os", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]


@pytest.mark.timeout(120)
def test_responses_streaming_and_non_streaming(client):
    full = client.responses.create(model=MODEL, input="Hello", max_output_tokens=8, temperature=0, extra_body=NO_THINKING)
    assert full.status == "incomplete" and full.usage.output_tokens == 8
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=8, temperature=0,
                                          stream=True, extra_body=NO_THINKING))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 8


SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_returns_valid_json(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        kw = dict(max_tokens=120, seed=seed, response_format=fmt, extra_body=NO_THINKING)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in chat(client, stream=True, **kw) if c.choices)
        else:
            out = chat(client, **kw)
            assert out.choices[0].finish_reason == "stop"
            text = out.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)


TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}]


@pytest.mark.timeout(180)
def test_strict_tool_call_round_trips(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                         max_tokens=400, seed=1, extra_body=NO_THINKING)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    # the call and its result go back as history: the next turn renders them and answers
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    nxt = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=5,
                                         extra_body=NO_THINKING)
    assert nxt.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # streamed, the same call arrives as tool-call deltas
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages[:1], tools=TOOLS,
                                                 tool_choice="required", max_tokens=400, seed=1, stream=True,
                                                 extra_body=NO_THINKING))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert streamed and streamed[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in streamed)
    assert json.loads(args) == json.loads(call.function.arguments)


@pytest.mark.timeout(120)
def test_anthropic_messages(server):
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    msg = ac.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}],
                             thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert msg.type == "message" and msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 8
    with ac.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}],
                            thinking={"type": "disabled"}, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.usage.output_tokens == 8


BAD = [
    ("/v1/chat/completions", b"{not json", 400, "not JSON"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-4"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400,
     "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
     400, "context length"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                              "frequency_penalty": 3, **NO_THINKING}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                              "response_format": {"type": "regex", "regex": "(unclosed"}, **NO_THINKING}, 400, ""),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2, "n": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "nope"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 9000}, 400, "max_model_len"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": []}, 400, "message"),
    ("/v1/responses", {"model": MODEL, "input": "x", "temperature": -1}, 400, "temperature"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path,body,status,words", BAD, ids=[f"{p}-{i}" for i, (p, *_r) in enumerate(BAD)])
def test_bad_requests_are_one_line_4xx(server, path, body, status, words):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}{path}", headers={"content-type": "application/json"}, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert "\n" not in err["message"] and words.lower() in err["message"].lower(), err["message"]
    assert server.idle(), "a refused request left work or cache behind"


@pytest.mark.timeout(120)
def test_disconnected_stream_is_aborted_and_frees_its_cache(server):
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 2000, "stream": True, "temperature": 1.0}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(ln.startswith("data: ") for ln in got)
            assert server.cache.num_used_blocks > 0  # running: it holds cache
    assert server.idle(timeout=30), "the aborted request still holds cache"


@pytest.mark.timeout(120)
def test_disconnected_non_streaming_request_is_aborted(server):
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 4000, "temperature": 1.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.5)
    assert server.idle(timeout=30), "the request of a client that left still runs"


@pytest.mark.timeout(60)
def test_full_admission_queue_answers_429(server, client):
    saved = server.state.max_in_flight
    server.state.max_in_flight = 0
    try:
        with pytest.raises(openai.RateLimitError):
            chat(client, max_tokens=2)
    finally:
        server.state.max_in_flight = saved
    assert chat(client, max_tokens=2, extra_body=NO_THINKING).choices[0].finish_reason == "length"


def test_the_server_engine_honours_the_decoding_settings():
    """decoding=dspark reaches the server's engine (its options once lacked the decoding section)."""
    srv = ThreadServer(["decoding=dspark"])
    try:
        assert srv.engine.client.core.options.num_draft_tokens == 5
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        metrics = {ln.split("{")[0]: float(ln.split()[-1]) for ln in httpx.get(srv.url + "/metrics").text.splitlines()
                   if ln.startswith("deepinfer_spec_decode_num_")}  # DSpark's counters, vLLM's spec_decode names
        drafts = metrics["deepinfer_spec_decode_num_draft_tokens_total"]
        assert drafts > 0 and 0 <= metrics["deepinfer_spec_decode_num_accepted_tokens_total"] <= drafts
    finally:
        srv.close()
