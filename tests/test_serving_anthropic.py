"""Anthropic's Messages API as Anthropic defines it, through the official `anthropic` client: tool_choice any / tool
/ none enforced, /v1/messages/count_tokens, max_tokens required."""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import MODEL

anthropic = pytest.importorskip("anthropic")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": CITY},
         {"name": "get_time", "description": "The local time in a city", "input_schema": CITY}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
OFF = {"type": "disabled"}


@pytest.fixture()
def ac(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def ask(ac, tool_choice, **kw):
    return ac.messages.create(model=MODEL, max_tokens=48, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                              thinking=OFF, extra_body={"temperature": 0}, **kw)


@pytest.mark.timeout(180)
def test_tool_choice_any_forces_a_call_of_one_of_the_tools(ac):
    msg = ask(ac, {"type": "any"})
    assert msg.content[0].type == "tool_use" and msg.content[0].name in {t["name"] for t in TOOLS}


@pytest.mark.timeout(180)
def test_tool_choice_tool_forces_a_call_of_that_tool(ac):
    msg = ask(ac, {"type": "tool", "name": "get_time"})
    assert msg.content[0].type == "tool_use" and msg.content[0].name == "get_time"


@pytest.mark.timeout(180)
def test_tool_choice_none_never_calls_a_tool(ac):
    msg = ask(ac, {"type": "none"})  # the parser reads no tool call whatever the model writes
    assert msg.content and all(block.type == "text" for block in msg.content) and msg.stop_reason != "tool_use"


@pytest.mark.timeout(60)
def test_tool_choice_any_with_thinking_is_refused_as_anthropic_refuses_it(ac):
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        ac.messages.create(model=MODEL, max_tokens=48, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
                           thinking={"type": "enabled", "budget_tokens": 16})


@pytest.mark.timeout(120)
def test_count_tokens_is_the_input_tokens_a_request_reports(ac):
    counted = ac.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS, thinking=OFF)
    msg = ac.messages.create(model=MODEL, max_tokens=1, messages=ASK, tools=TOOLS, thinking=OFF)
    # Anthropic's usage.input_tokens leaves out the prompt tokens read from the prefix cache (earlier tests in this
    # module sent the same tools): the prompt is both together
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


@pytest.mark.timeout(60)
def test_max_tokens_is_required(server):
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": ASK}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens is required" in r.json()["error"]["message"]
