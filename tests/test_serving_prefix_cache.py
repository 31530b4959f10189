"""Every API reports the prompt tokens the prefix cache held: OpenAI's usage.prompt_tokens_details.cached_tokens,
DeepSeek's prompt_cache_hit_tokens / prompt_cache_miss_tokens, Anthropic's cache_read_input_tokens. A request that
resends a long system prompt finds it cached the second time (the embedded model, cache blocks of 64 tokens)."""

from __future__ import annotations

import httpx

from serving_helpers import openai_client

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
