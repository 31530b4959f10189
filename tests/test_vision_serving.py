"""Images over HTTP on embedded:tiny-random-vision, through the official clients over loopback: OpenAI `image_url`
content parts (data: URLs) and Anthropic `image` blocks (base64). A remote URL, an image that does not decode, a
bad data URL or a text-only model are 400s naming the content part; image tokens count in usage."""

from __future__ import annotations

import base64

import httpx
import pytest

from serving_helpers import ThreadServer, openai_client
from vision_fixture import png

openai = pytest.importorskip("openai")

MODEL = "deepinfer-embedded-tiny-random-vision"
NO_THINKING = {"extra_body": {"thinking": {"type": "disabled"}}}


@pytest.fixture(scope="module")
def server():
    srv = ThreadServer(["model.path=embedded:tiny-random-vision", "engine.max_num_seqs=8"])
    yield srv
    srv.close()


def data_url(n: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(n)).decode()


def chat(client, *images, text="Describe it.", max_tokens=6):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        max_tokens=max_tokens, temperature=0, **NO_THINKING)


def test_openai_chat_takes_data_url_images_and_counts_their_tokens(server):
    client = openai_client(server)
    r0 = chat(client, data_url(0))
    assert r0.id and r0.usage.completion_tokens == 6
    again, other, text = chat(client, data_url(0)), chat(client, data_url(2)), chat(client)
    assert again.choices[0].message.content == r0.choices[0].message.content
    assert other.choices[0].message.content != r0.choices[0].message.content
    # the placeholder (one token) became the whole span: the tiny config's case-0 span has more than 2 tokens
    assert r0.usage.prompt_tokens > text.usage.prompt_tokens + 2
    two = chat(client, data_url(0), data_url(1))
    assert two.usage.prompt_tokens > r0.usage.prompt_tokens


def test_anthropic_messages_take_base64_image_blocks(server):
    anthropic = pytest.importorskip("anthropic")
    ac = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(1)).decode()}}
    msg = ac.messages.create(model=MODEL, max_tokens=5, thinking={"type": "disabled"}, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": [block, {"type": "text", "text": "What?"}]}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
    plain = ac.messages.create(model=MODEL, max_tokens=5, thinking={"type": "disabled"}, extra_body={"temperature": 0},
                               messages=[{"role": "user", "content": "What?"}])
    assert msg.usage.input_tokens > plain.usage.input_tokens + 2


def _post(server, content, model=MODEL) -> httpx.Response:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}],
            "thinking": {"type": "disabled"}}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "remote image URLs are not fetched by this server; allowed: a data: URL"),
    ("data:image/png;base64," + base64.b64encode(png(0)[:len(png(0)) // 2]).decode(), "corrupt image"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a....").decode(), "not a readable image; allowed: PNG"),
])
def test_bad_images_are_400s_naming_the_content_part(server, url, message):
    r = _post(server, [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and "\n" not in err["message"]
    assert err["param"] == "messages[0].content[1]" and err["message"].startswith("messages[0].content[1]: ")
    assert server.idle()  # nothing reached the engine


def test_a_data_url_that_is_not_base64_is_a_400(server):
    """deepseek_recipe checks the data URL's body itself while parsing the request."""
    r = _post(server, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])
    assert r.status_code == 400 and "base64" in r.json()["error"]["message"]


def test_a_text_only_model_answers_images_with_a_400():
    srv = ThreadServer()
    try:
        r = _post(srv, [{"type": "image_url", "image_url": {"url": data_url(0)}}], model="deepinfer-embedded-tiny")
        assert r.status_code == 400
        assert "this model has no vision tower" in r.json()["error"]["message"]
    finally:
        srv.close()
