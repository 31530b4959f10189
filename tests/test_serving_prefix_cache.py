"""Every API reports the prompt tokens the prefix cache held: OpenAI's usage.prompt_tokens_details.cached_tokens,
DeepSeek's prompt_cache_hit_tokens / prompt_cache_miss_tokens, Anthropic's cache_read_input_tokens. A request that
resends a long system prompt finds it cached the second time (the embedded model, cache blocks of 64 tokens)."""

from __future__ import annotations

import httpx
import pytest

from serving_helpers import openai_client, wait_for

MODEL = "deepinfer-embedded-tiny"
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(40))


def test_a_resent_system_prompt_is_reported_cached_by_the_openai_and_deepseek_fields(server):
    client = openai_client(server)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 128
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 64 <= cached < second.usage.prompt_tokens and cached % 64 == 0
    assert second.choices[0].message.content == first.choices[0].message.content
    usage = second.model_dump()["usage"]
    assert usage["prompt_cache_hit_tokens"] == cached
    assert usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"] - cached


def test_completions_and_anthropic_messages_report_the_cached_prompt_tokens(server):
    client = openai_client(server)
    prompt = SYSTEM + " Question: what is 2 + 2?"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "system": SYSTEM, "messages": [{"role": "user", "content": "Hi"}]}
    runs = [httpx.post(f"{server.url}/v1/messages", json=body, timeout=60).json() for _ in range(2)]
    # (the chat test before may have cached the same rendered system prompt already)
    assert runs[1]["usage"]["cache_read_input_tokens"] >= max(64, runs[0]["usage"].get("cache_read_input_tokens", 0))
    assert runs[1]["content"] == runs[0]["content"]


def _metric(text: str, name: str) -> float:
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + "{")).split()[-1])


def test_cache_salt_isolates_tenants_on_chat_completions_and_anthropic_messages(server):
    """vLLM's `cache_salt` body field: a salted request never reads a prefix cached by an unsalted or differently
    salted one (0 cached tokens), the same salt shares; the answers are the same throughout."""
    client = openai_client(server)
    system = "Tenant isolation check. " + SYSTEM

    def chat(salt=None):
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": system},
                                                                  {"role": "user", "content": "Hi"}],
                                           max_tokens=2, temperature=0, **extra)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    runs = [chat(), chat(), chat("tenant-a"), chat("tenant-a"), chat("tenant-b")]
    assert [c > 0 for c, _ in runs] == [False, True, False, True, False], runs
    assert len({text for _, text in runs}) == 1

    prompt = "Completions tenant check. " + SYSTEM
    done = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={} if salt is None else {"cache_salt": salt})
            for salt in (None, None, "tenant-a", "tenant-a")]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in done] == [False, True, False, True]

    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "system": "Anthropic tenant check. " + SYSTEM,
            "messages": [{"role": "user", "content": "Hi"}]}
    msgs = [httpx.post(f"{server.url}/v1/messages", json={**body, **extra}, timeout=60).json()
            for extra in ({}, {}, {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"})]
    assert [m["usage"].get("cache_read_input_tokens", 0) > 0 for m in msgs] == [False, True, False, True], msgs
    assert all(m["content"] == msgs[0]["content"] for m in msgs)


@pytest.mark.parametrize("path,salt", [("/v1/chat/completions", 7), ("/v1/completions", ""),
                                       ("/v1/messages", "x" * 1025), ("/v1/responses", ["a"])])
def test_a_bad_cache_salt_is_a_one_line_400_naming_the_field(server, path, salt):
    body = {"model": MODEL, "max_tokens": 2, "cache_salt": salt}
    body.update({"/v1/completions": {"prompt": "x"}, "/v1/responses": {"input": "x", "max_output_tokens": 2}}.get(
        path, {"messages": [{"role": "user", "content": "x"}]}))
    if path == "/v1/responses":
        del body["max_tokens"]
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"] if "error" in r.json() else r.text
    assert "\n" not in message and "cache_salt" in message and "1024" in message, message


def test_metrics_report_prefix_cache_queries_hits_rate_evictions_and_checkpoint_bytes(server):
    client = openai_client(server)
    messages = [{"role": "system", "content": "Metrics check. " + SYSTEM}, {"role": "user", "content": "Hi"}]
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert server.idle()
    stats = server.cache.prefix_stats()  # the engine's own counters; the metrics show them once its last step is in
    taken = "deepinfer_prefix_cache_checkpoints_taken_total"
    assert wait_for(lambda: _metric(httpx.get(f"{server.url}/metrics").text, taken) == stats["checkpoints_taken"])
    text = httpx.get(f"{server.url}/metrics").text
    queries = _metric(text, "deepinfer_prefix_cache_queries_total")
    hits = _metric(text, "deepinfer_prefix_cache_hits_total")
    assert queries >= hits >= 64
    assert _metric(text, "deepinfer_prefix_cache_hit_rate") == pytest.approx(hits / queries)
    assert _metric(text, "deepinfer_prefix_cache_checkpoint_bytes") == stats["checkpoint_bytes"] > 0
    assert _metric(text, "deepinfer_prefix_cache_checkpoints") == stats["checkpoints"]
    assert _metric(text, "deepinfer_prefix_cache_evicted_blocks_total") == stats["evicted_blocks"]
    assert _metric(text, "deepinfer_prefix_cache_evicted_checkpoints_total") == stats["evicted_checkpoints"]
