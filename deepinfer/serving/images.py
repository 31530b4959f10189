"""Image content parts of a chat request -> image spans in its prompt (VISION_SPEC.md §2.2).

deepseek_recipe parses the parts (OpenAI `image_url`, Responses `input_image`, Anthropic `image`) into each message's
image sources and renders one `<｜image｜>` placeholder per image; here each source becomes its bytes and the
prompt's placeholders become the images' spans (frontend/images.py). Only inline images are taken: a data: URL
with base64 bytes, or Anthropic's base64 source. A remote URL is refused: this server fetches nothing from the
network. Every refusal is a 400 naming the content part (the recipe's path, e.g. messages.0.content[1]).
"""

from __future__ import annotations

import base64
import binascii

from deepinfer.frontend.images import ImagePromptError, ImagePrompts
from deepinfer.serving.errors import bad_request


def source_bytes(source, where: str) -> bytes:
    """The encoded image of one deepseek_recipe ImageSource, or a 400 naming where it sits."""
    if source.kind == "bytes":
        return bytes(source.data)
    if source.kind == "url":
        raise bad_request(f"{where}: remote image URLs are not fetched by this server; allowed: a data: URL with "
                          "base64 image bytes (data:image/png;base64,...)", where)
    head, comma, body = (source.data_url or "").partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        raise bad_request(f"{where}: not a base64 data URL; allowed: data:image/png;base64,... (PNG, JPEG or WebP)",
                          where)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the data URL's base64 body does not decode; allowed: standard base64",
                          where) from None


def part_names(sources, body: dict | None) -> list[str]:
    """Where each image sits in the request: for Chat Completions `messages[i].content[j]` from the body (the
    recipe's path names only the message there), else the recipe's path (Anthropic: messages.0.content[1])."""
    names = [(s.path or f"image {i}").lstrip(".") for i, s in enumerate(sources)]
    messages = (body or {}).get("messages")
    if not isinstance(messages, list):
        return names
    parts = [f"messages[{i}].content[{j}]" for i, msg in enumerate(messages) if isinstance(msg, dict)
             and isinstance(msg.get("content"), list)
             for j, part in enumerate(msg["content"]) if isinstance(part, dict) and part.get("type") == "image_url"]
    return parts if len(parts) == len(sources) and all(n.startswith("messages[") for n in names) else names


def expand_images(prompts: ImagePrompts, prompt_ids: list[int], conversation, body: dict | None = None
                  ) -> tuple[list[int], list]:
    """(prompt ids with each image placeholder expanded into its span, the messages.ImageInput per image). body:
    the request body, to name the content parts in errors."""
    sources = [s for m in conversation.messages for s in m.image_sources]
    if not sources:
        return prompt_ids, []
    names = part_names(sources, body)
    data = [source_bytes(s, name) for s, name in zip(sources, names)]
    try:
        return prompts.expand(prompt_ids, data, field="messages", names=names)
    except ImagePromptError as exc:
        raise bad_request(str(exc), exc.field) from None
