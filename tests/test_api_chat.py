"""LLM.chat (vLLM's offline chat API): conversations rendered by deepseek_recipe exactly as the server's
/v1/chat/completions renders them, then generated as generate() does."""

from __future__ import annotations

import httpx
import pytest

from deepinfer import LLM, SamplingParams

HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm():
    with LLM(process="inproc", cache={"memory_budget": 134217728}) as model:
        yield model


def test_a_conversation_gets_the_prompt_the_server_renders_for_it(llm, server):
    [out] = llm.chat(HELLO, GREEDY, use_tqdm=False)
    served = httpx.post(f"{server.url}/tokenize", json={"messages": HELLO}, timeout=60).json()
    assert out.prompt_token_ids == served["tokens"] and len(out.token_ids) == 4
    [plain] = llm.generate(prompt_token_ids=[out.prompt_token_ids], sampling_params=GREEDY, use_tqdm=False)
    assert plain.token_ids == out.token_ids


def test_a_list_of_conversations_gets_one_output_each(llm):
    convs = [HELLO, [{"role": "system", "content": "Be brief."}, *HELLO]]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert len(outs) == 2 and outs[0].prompt_token_ids != outs[1].prompt_token_ids


def test_thinking_and_tools_change_the_rendered_prompt(llm):
    tok = llm.program.tokenize.tokenizer
    off, on = (llm.chat(HELLO, GREEDY, use_tqdm=False, thinking=t)[0].prompt_token_ids for t in (False, True))
    assert tok.decode(off, skip_special_tokens=False).endswith("</think>")  # thinking off: the answer starts
    assert tok.decode(on, skip_special_tokens=False).endswith("<think>")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    [with_tools] = llm.chat(HELLO, GREEDY, use_tqdm=False, tools=[tool])
    assert "get_weather" in tok.decode(with_tools.prompt_token_ids, skip_special_tokens=False)


@pytest.mark.parametrize("messages, thinking, words", [
    ([{"role": "wizard", "content": "x"}], None, "conversation 0"),
    (HELLO, "yes", "chat(thinking='yes') is invalid; allowed: None, True or False"),
])
def test_a_conversation_the_recipe_refuses_is_one_line_value_error(llm, messages, thinking, words):
    with pytest.raises(ValueError) as info:
        llm.chat(messages, GREEDY, use_tqdm=False, thinking=thinking)
    assert words in str(info.value) and "\n" not in str(info.value)
