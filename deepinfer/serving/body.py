"""The request body: parsed as JSON (`json_body`) and held to limits before any conversion: how deep it nests, how
large its numbers are, and how many characters of prompt it carries. Each breach is a 400 naming the field (its path
in the body). The body's size and the time it may take to arrive are bounded before this (serving/guard.py).

- Depth: at most MAX_DEPTH containers (the body object counts as one), deepseek_recipe's own limit (serde_json's
  128): deeper bodies made the conversion raise a RecursionError (a 500) before this check.
- Numbers: integers within 64 bits ([-2**63, 2**64 - 1]: seeds are unsigned 64-bit) and finite floats (a JSON
  number such as 1e400 parses to infinity in Python).
- Prompt characters: a prompt of more characters than max_model_len times the longest token of the vocabulary (in
  characters) cannot fit the context whatever it tokenizes to, so it is refused without being tokenized (a
  2M-character prompt took seconds of tokenizer time before the length check).

The walk is iterative (no recursion however deep the body), and stops at the first breach.
"""

from __future__ import annotations

import json
import math

from starlette.requests import Request

from deepinfer.serving.errors import bad_request

MAX_DEPTH = 128
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
# the fields that carry prompt text, per protocol (tools render into the prompt too); image data is not text
PROMPT_FIELDS = ("messages", "prompt", "input", "instructions", "system", "tools")
NOT_TEXT = ("image_url", "source", "url", "data")


async def json_body(request: Request) -> dict:
    """The request's body as a JSON object within the limits above, or a 400 saying what it is instead."""
    raw = await request.body()
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise bad_request(f"the request body is not JSON ({getattr(exc, 'msg', None) or _first(exc)})") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body is a JSON {type(body).__name__}; allowed: a JSON object")
    check_body(body)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _first(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _path(parts: tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "the request body"


def check_body(body) -> None:
    """Depth and number ranges of a parsed JSON body; a 400 naming the first field that breaks them."""
    stack = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                where = _path(path)
                raise bad_request(f"the request body is nested more than {MAX_DEPTH} levels deep at "
                                  f"{where[:200]}; allowed: at most {MAX_DEPTH} levels", where.split(".")[0][:60])
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((v, path + (k,), depth + 1) for k, v in items)
        elif isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                where = _path(path)
                raise bad_request(f"{where}={_short(value)} is out of range; allowed: an integer within 64 bits "
                                  f"([{INT_MIN}, {INT_MAX}])", where)
        elif isinstance(value, float) and not math.isfinite(value):
            where = _path(path)
            raise bad_request(f"{where}={value} is out of range; allowed: a finite number", where)


def check_prompt_chars(body: dict, max_model_len: int, longest_token: int) -> None:
    """A 400 when the prompt fields hold more characters than any prompt of max_model_len tokens can."""
    limit = max_model_len * longest_token
    total, stack = 0, [body.get(k) for k in PROMPT_FIELDS if isinstance(body, dict)]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
            if total > limit:
                raise bad_request(f"the prompt holds more than {limit} characters, more than max_model_len="
                                  f"{max_model_len} tokens of at most {longest_token} characters each can hold; "
                                  f"allowed: at most {limit} characters", "messages" if "messages" in body
                                  else "prompt" if "prompt" in body else "input")
        elif isinstance(value, dict):
            stack.extend(v for k, v in value.items() if k not in NOT_TEXT)
        elif isinstance(value, list):
            stack.extend(value)


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"
