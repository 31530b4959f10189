"""Issue 24's HTTP surface on the embedded model, through the official `openai` client over loopback: logprobs and
top_logprobs on both OpenAI endpoints (streaming too), echo with prompt logprobs (lm-eval's loglikelihood
requests), n and best_of, prompt lists, max_completion_tokens, vLLM's extra sampling fields on both endpoints, one
rule for unknown fields, JSON schemas judged by the grammar compiler, model names, the thinking default.

The model has random-ish weights: the tests check what the server guarantees whatever it writes (shapes, counts,
agreement between endpoints, between streaming and not, and with the engine's own numbers).
"""

from __future__ import annotations

import json
import logging
import math

import httpx
import jsonschema
import pytest
from serving_helpers import MODEL, ThreadServer, openai_client

openai = pytest.importorskip("openai")


@pytest.fixture()
def client(server):  # server: tests/conftest.py's, one per module
    return openai_client(server, timeout=120)


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], **kw)


def prompt_ids(server, text: str) -> list[int]:
    return server.state.converter.tokenizer.encode(text).ids


# ---- completions: what lm-eval's local-completions sends ---------------------------------------------------------
@pytest.mark.timeout(180)
def test_lm_eval_loglikelihood_request_shape(server, client):
    """lm-eval loglikelihood: a batch of token-id prompts, echo=True, logprobs=1, max_tokens=1, temperature=0; it
    reads choices (by index) and sums token_logprobs[ctxlen:-1]; is_greedy compares each with max(top_logprobs)."""
    ctx, cont = prompt_ids(server, "def add(a, b):"), prompt_ids(server, "\n    return a + b")
    batch = [ctx + cont, ctx[:3] + cont]
    out = client.completions.create(model=MODEL, prompt=batch, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                    seed=1234)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, ids in zip(out.choices, batch):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
        for tok, lpv, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert top[tok] == lpv and len(top) in (1, 2)  # the chosen token and the most likely one
            assert max(top.values()) >= lpv
        # greedy: the generated token is the most likely one
        assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
        assert choice.text.startswith(server.state.converter.tokenizer.decode(ids, skip_special_tokens=False))
        assert lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens == sum(map(len, batch)) and out.usage.completion_tokens == 2


@pytest.mark.timeout(180)
def test_echo_prompt_logprobs_agree_with_generated_logprobs(server, client):
    """The engine's prompt logprobs are the model's: the logprob of a greedily generated token equals the prompt
    logprob of the same token once it is part of the prompt (max_tokens=0: only the prompt comes back)."""
    ids = prompt_ids(server, "import os\nimport sys\n")
    gen = client.completions.create(model=MODEL, prompt=ids, logprobs=2, max_tokens=1, temperature=0)
    lp = gen.choices[0].logprobs
    assert len(lp.tokens) == 1 and len(lp.top_logprobs[0]) in (2, 3)
    next_id = server.state.converter.tokenizer.token_to_id(lp.tokens[0])
    if next_id is None:  # a byte-level piece that is not a vocabulary string: look it up by decoding
        vocab = server.state.converter.tokenizer.get_vocab()
        next_id = next(i for i in vocab.values()
                       if server.state.converter.tokenizer.decode([i], skip_special_tokens=False) == lp.tokens[0])
    echo = client.completions.create(model=MODEL, prompt=ids + [next_id], echo=True, logprobs=1, max_tokens=0)
    choice = echo.choices[0]
    assert choice.finish_reason == "length" and echo.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(ids) + 1  # the prompt only
    assert math.isclose(choice.logprobs.token_logprobs[-1], lp.token_logprobs[0], rel_tol=1e-4, abs_tol=1e-4)
    assert choice.text == server.state.converter.tokenizer.decode(ids + [next_id], skip_special_tokens=False)


@pytest.mark.timeout(180)
def test_prompt_list_of_strings_and_n(client):
    prompts = ["def f(", "class A"]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, seed=3, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt-major: prompt i's samples at 2i, 2i + 1
    one = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, seed=3, temperature=1.0) for p in prompts]
    # sample 0 of n keeps the request's seed: it is the n=1 answer
    assert out.choices[0].text == one[0].choices[0].text and out.choices[2].text == one[1].choices[0].text
    assert out.usage.completion_tokens == sum(1 for _ in out.choices) * 5 or all(
        c.finish_reason in ("length", "stop") for c in out.choices)
    assert out.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one)


@pytest.mark.timeout(180)
def test_generate_until_batch_with_stop_matches_single_requests(client):
    """lm-eval generate_until at --batch_size > 1: a prompt list with stop sequences, greedy."""
    prompts = ["import os", "def main():"]
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
    stops = [s.choices[0].text[3:5] or "\n" for s in single]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0, stop=stops)
    for choice, s in zip(batch.choices, single):
        text = s.choices[0].text
        cut = min((text.index(x) for x in stops if x in text), default=len(text))
        assert choice.text == text[:cut]


@pytest.mark.timeout(180)
def test_completions_streaming_logprobs_equal_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt="def f(", max_tokens=8, temperature=0, logprobs=3)
    chunks = list(client.completions.create(model=MODEL, prompt="def f(", max_tokens=8, temperature=0, logprobs=3,
                                            stream=True, stream_options={"include_usage": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert tokens == full.choices[0].logprobs.tokens and lps == full.choices[0].logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert "".join(full.choices[0].logprobs.tokens) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.timeout(180)
def test_streaming_prompt_list_with_n(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=4, seed=1, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    full = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=4, seed=1)
    assert texts == {c.index: c.text for c in full.choices}
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens


@pytest.mark.timeout(180)
def test_best_of_returns_the_samples_of_highest_mean_logprob(client):
    kw = dict(model=MODEL, prompt="def f(", max_tokens=6, seed=11, temperature=1.0, logprobs=0)
    all3 = client.completions.create(n=3, **kw)
    best = client.completions.create(n=1, best_of=3, **kw)
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in all3.choices]
    assert len(best.choices) == 1 and best.choices[0].text == all3.choices[mean.index(max(mean))].text
    assert best.usage.completion_tokens == all3.usage.completion_tokens  # every sample run is counted


# ---- chat ----------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_chat_logprobs_streaming_and_not(client):
    full = chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens or full.choices[0].finish_reason == "stop"
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == max(t.logprob, t.top_logprobs[0].logprob) for t in content)  # greedy: the top one
    assert "".join(t.token for t in content) == full.choices[0].message.content
    chunks = list(chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = chat(client, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content == full.choices[0].message.content and plain.choices[0].logprobs is None


@pytest.mark.timeout(180)
def test_chat_n_and_max_completion_tokens(client):
    out = chat(client, n=3, max_completion_tokens=5, seed=2)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("length", "stop") for c in out.choices)
    assert out.usage.completion_tokens <= 15 and out.usage.completion_tokens >= sum(
        5 for c in out.choices if c.finish_reason == "length")
    one = chat(client, max_completion_tokens=5, seed=2)
    assert one.usage.completion_tokens <= 5 and out.choices[0].message.content == one.choices[0].message.content
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    two = chat(client, n=2, max_completion_tokens=5, seed=2)
    chunks = list(chat(client, n=2, max_completion_tokens=5, seed=2, stream=True,
                       stream_options={"include_usage": True}))
    texts = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert texts == {0: two.choices[0].message.content, 1: two.choices[1].message.content}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == two.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


# ---- vLLM's extra sampling fields, the same on both endpoints ------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_vllm_sampling_fields(server, client, endpoint):
    def run(**kw):
        if endpoint == "chat":
            out = chat(client, **kw)
            return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens
        out = client.completions.create(model=MODEL, prompt="def f(", **kw)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

    greedy = run(max_tokens=8, temperature=0)
    assert run(max_tokens=8, temperature=1.0, seed=5, extra_body={"top_k": 1}) == greedy
    assert run(max_tokens=8, temperature=1.0, seed=5, extra_body={"min_p": 1.0}) == greedy
    text, finish, count = run(max_tokens=8, temperature=0, extra_body={"repetition_penalty": 1.5})
    assert count == 8 or finish == "stop"
    eos = server.engine.info.eos_token_id
    text, finish, count = run(max_tokens=8, temperature=0, extra_body={"min_tokens": 8, "ignore_eos": True})
    assert count == 8 and finish == "length"
    # stop_token_ids: the greedy text's second token ends the request (it is not part of the text)
    tok = server.state.converter.tokenizer
    ids = tok.encode(greedy[0], add_special_tokens=False).ids
    if len(ids) >= 3 and ids[1] != eos:
        text, finish, _ = run(max_tokens=8, temperature=0, extra_body={"stop_token_ids": [ids[1]]})
        assert finish == "stop" and greedy[0].startswith(text) and len(text) < len(greedy[0])
    # logit_bias: +100 makes a token the greedy choice every time, -100 bans the greedy text's first token
    forced = tok.encode("x", add_special_tokens=False).ids[0]
    text, _, _ = run(max_tokens=4, temperature=0, extra_body={"logit_bias": {str(forced): 100},
                                                              "ignore_eos": True})
    assert text == "x" * 4
    if ids:
        text, _, _ = run(max_tokens=4, temperature=0, extra_body={"logit_bias": {str(ids[0]): -100}})
        assert not text.startswith(tok.decode([ids[0]]))
    # the choice list (structured outputs, vLLM's forms)
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        text, finish, _ = run(max_tokens=8, temperature=1.0, seed=1, extra_body=extra)
        assert text in ("yes", "no") and finish == "stop"
    text, _, _ = run(max_tokens=8, seed=1, extra_body={"guided_regex": "[0-9]{3}"})
    assert len(text) == 3 and text.isdigit()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    text, finish, _ = run(max_tokens=300, temperature=0.3, seed=1, extra_body={"structured_outputs": {"json": schema}})
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path,base", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": "x"}),
])
def test_vllm_fields_are_checked_alike_and_unknown_fields_ignored(server, path, base, caplog):
    base = {**base, "model": MODEL, "max_tokens": 2}
    for extra, word in (({"repetition_penalty": 0}, "repetition_penalty"), ({"top_k": -5}, "top_k"),
                        ({"min_p": 2}, "min_p"), ({"min_tokens": 5}, "min_tokens"),
                        ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided"),
                        ({"stop_token_ids": ["x"]}, "stop_token_ids")):
        r = post(server, path, {**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert word in r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"]
    with caplog.at_level(logging.WARNING, logger="deepinfer.serving"):
        r = post(server, path, {**base, "invented_key": 1, "another": {"x": 1}})
    assert r.status_code == 200, r.text
    assert r.headers["x-deepinfer-ignored-fields"] == "another,invented_key"
    assert "another, invented_key" in caplog.text  # the one rule: ignored, logged, named in the header
    assert server.idle()


# ---- schemas: the grammar compiler is the judge --------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schema", [
    {"enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
])
def test_valid_schemas_are_honoured_strict_or_not(client, schema):
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": strict}}
        out = chat(client, max_tokens=300, temperature=0.3, seed=0, response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


@pytest.mark.timeout(120)
def test_a_schema_the_compiler_refuses_is_a_400_naming_the_construct(server):
    for schema, words in (({"type": "string", "pattern": "(?<=a)b"}, "lookbehind"),
                          ({"type": "strin"}, "strin")):
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 4, "response_format": fmt})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert words in msg.lower() and "\n" not in msg, msg
    assert server.idle()


def _enum(values: list[str]) -> dict:
    return {"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]}


@pytest.mark.timeout(120)
def test_a_100k_value_enum_under_1_mib_is_a_400_naming_the_field_and_the_limit(server):
    """Bytes alone would let it through (900,064 bytes); its number of values does not."""
    enum = _enum([f"v{i:05d}" for i in range(100_000)])
    assert len(json.dumps(enum, separators=(",", ":"))) < 2**20
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    for path, extra, field in (
            ("/v1/chat/completions", {"structured_outputs": {"json": enum}}, "structured_outputs.json"),
            ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": enum}}}, "response_format"),
            ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": enum}}},
             "text.format")):
        r = post(server, path, {**base, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["message"].startswith(f"{field} has 100007 values")
        assert err["message"].endswith("allowed: at most 32768")


@pytest.mark.timeout(120)
def test_a_client_at_its_grammar_bound_gets_429_and_another_client_is_served(server):
    """The client is the peer's address: 127.0.0.1 has its heavy compilations at the bound (held in the engine's
    queue), so its next heavy schema is a 429; 127.0.0.2's is compiled in the heavy lane 127.0.0.1 leaves free."""
    import threading

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "structured_outputs": {"json": _enum([f"value{i}" for i in range(2000)])}}  # 24 KB: a heavy schema
    light = {**body, "structured_outputs": {"regex": "[a-z]{3}"}}
    assert post(server, "/v1/chat/completions", light).status_code == 200  # the engine's compiler pool exists
    queue = server.engine.client.core.grammars._pool._queue
    release = threading.Event()
    held = [queue.submit(release.wait, cost=10**9, client="127.0.0.1") for _ in range(queue.max_per_client)]
    try:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_exceeded" and "\n" not in err["message"]
        assert f"allowed: at most {queue.max_per_client} at once" in err["message"]
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=120)
        with other:
            assert other.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200
    finally:
        release.set()
    assert all(f.result(60) is True for f in held)
    assert post(server, "/v1/chat/completions", body).status_code == 200  # room again
    assert server.idle()


# ---- model names ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_unknown_model_is_404_model_not_found_on_every_endpoint(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("DeepSeek-V4.1-Flash")
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "x", "max_tokens": 2},
        "/v1/responses": {"input": "x", "max_output_tokens": 2},
        "/v1/messages": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    }
    for name in ("gpt-4", "DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"):  # the API names belong to the real models
        for path, body in bodies.items():
            r = post(server, path, {**body, "model": name})
            assert r.status_code == 404, (path, name, r.text)
            err = r.json()["error"]
            if path == "/v1/messages":
                assert err["type"] == "not_found_error" and name in err["message"]
            else:
                assert err["code"] == "model_not_found" and name in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="DeepSeek-V4.1-Flash", prompt="x", max_tokens=1)
    r = post(server, "/v1/chat/completions", {"model": ["a"], "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # no model: the served one (vLLM's rule)
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_served_names_and_thinking_default_follow_the_model():
    from types import SimpleNamespace as NS

    from deepinfer.serving.server import default_thinking, model_identity, served_names

    def settings(path, names=None, thinking=None):
        return NS(model=NS(path=path), serve=NS(served_model_name=names, default_thinking=thinking))

    assert model_identity("embedded:tiny") == MODEL
    assert served_names(settings("embedded:tiny")) == [MODEL]
    assert served_names(settings("deepseek-ai/DeepSeek-V4.1-Flash-1017")) == [
        "deepseek-ai/DeepSeek-V4.1-Flash-1017", "DeepSeek-V4.1-Flash"]
    assert served_names(settings("/models/DeepSeek-V4-Pro/")) == ["DeepSeek-V4-Pro"]
    assert served_names(settings("/models/my-finetune")) == ["my-finetune"]
    assert served_names(settings("/models/DeepSeek-V4.1-Flash", ["flash", "v41"])) == ["flash", "v41",
                                                                                       "DeepSeek-V4.1-Flash"]
    assert served_names(settings("embedded:tiny", "a b")) == ["a", "b"]
    assert default_thinking(settings("embedded:tiny")) is False
    assert default_thinking(settings("deepseek-ai/DeepSeek-V4.1-Flash-1017")) is True
    assert default_thinking(settings("embedded:tiny", thinking=True)) is True


@pytest.mark.timeout(180)
def test_served_model_name_aliases():
    srv = ThreadServer(["serve.served_model_name=[flash,small]", "serve.default_thinking=true"])
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["flash", "small"]
        for name in ("flash", "small"):
            out = c.completions.create(model=name, prompt="x", max_tokens=2)
            assert out.model == name
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        # serve.default_thinking=true: a chat request that does not say thinks first
        out = c.chat.completions.create(model="flash", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        assert out.choices[0].message.model_extra.get("reasoning_content")
    finally:
        srv.close()


# ---- thinking: off by default on the embedded model, each endpoint's own switch turns it on -----------------------
@pytest.mark.timeout(180)
def test_thinking_default_and_each_endpoints_switch(server, client):
    out = chat(client, max_tokens=6, seed=7)
    assert out.choices[0].message.content and not out.choices[0].message.model_extra.get("reasoning_content")
    for extra in ({"thinking": {"type": "enabled"}}, {"reasoning_effort": "high"}):
        out = chat(client, max_tokens=6, seed=7, extra_body=extra)
        assert out.choices[0].message.model_extra.get("reasoning_content"), extra
    resp = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6)
    assert [o.type for o in resp.output] == ["message"]
    resp = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, reasoning={"effort": "high"})
    assert resp.output[0].type == "reasoning"
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    msg = ac.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hello"}])
    assert [b.type for b in msg.content] == ["text"]
    msg = ac.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hello"}],
                             thinking={"type": "enabled", "budget_tokens": 1024})
    assert msg.content[0].type == "thinking"


@pytest.mark.timeout(120)
def test_responses_top_logprobs(client):
    out = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0, top_logprobs=2,
                                  include=["message.output_text.logprobs"])
    part = out.output[0].content[0]
    assert part.logprobs and all(len(t.top_logprobs) == 2 for t in part.logprobs)
    assert "".join(t.token for t in part.logprobs) == part.text


NESTED = {"type": "object",
          "properties": {"color": {"enum": ["red", "green"]}, "size": {"const": 3},
                         "note": {"type": "string", "maxLength": 8}},
          "required": ["color", "size"]}


@pytest.mark.timeout(240)
def test_strict_schema_with_typeless_members_and_optional_properties(client):
    """Strict mode as the recipe reads it refuses these (enum/const without `type`, an optional property); the
    grammar compiler takes them, so they are honoured as given."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": NESTED, "strict": True}}
    out = chat(client, max_tokens=300, temperature=0.3, seed=0, response_format=fmt)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), NESTED)
    tools = [{"type": "function", "function": {"name": "paint", "parameters": NESTED, "strict": True}}]
    out = chat(client, max_tokens=300, temperature=0.3, seed=0, tools=tools, tool_choice="required")
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "paint"
    jsonschema.validate(json.loads(call.function.arguments), NESTED)


@pytest.mark.timeout(120)
def test_a_refused_prompt_or_sample_refuses_the_whole_request_and_frees_the_rest(server):
    long_prompt = [5] * (server.state.max_model_len + 10)
    for path, body in (
        ("/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7], long_prompt], "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 3, "max_tokens": 2,
                             "guided_regex": "(unclosed"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 3,
                                  "max_tokens": 2, "guided_grammar": "root ::= nope"}),
    ):
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        assert "\n" not in r.json()["error"]["message"]
        assert server.idle(), "a refused request left work or cache behind"


@pytest.mark.timeout(120)
def test_disconnected_stream_of_many_choices_frees_them_all(server):
    body = {"model": MODEL, "prompt": ["def f(", "class A"], "n": 2, "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any(ln.startswith("data: ") for ln in got)
            assert server.engine.num_in_flight == 4
    assert server.idle(timeout=30), "the aborted choices still hold cache"


@pytest.mark.timeout(120)
def test_anthropic_top_k_is_honoured(server):
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Hello"}]
    greedy = ac.messages.create(model=MODEL, max_tokens=8, messages=msgs, extra_body={"temperature": 0})
    top1 = ac.messages.create(model=MODEL, max_tokens=8, messages=msgs, extra_body={"temperature": 1.0, "top_k": 1})
    assert top1.content[0].text == greedy.content[0].text


@pytest.mark.timeout(60)
def test_an_integer_past_the_json_number_range_is_a_400(server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 10**30}),
                       ("/v1/responses", {"input": "x", "metadata": {"a": 10**30}}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 10**30})):
        r = post(server, path, {**body, "model": MODEL})
        assert r.status_code == 400, (path, r.text)
