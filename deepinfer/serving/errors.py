"""HTTP errors of the server: one line of text, the protocol's error shape, never a traceback.

A request the server cannot run is the client's error (400, 404 for an unknown model, 413 for a too-long prompt
is still 400 as OpenAI answers it), a full admission queue is 429, a dead or stopping engine is 503.
"""

from __future__ import annotations

import json

from starlette.requests import Request


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(" ".join(str(message).split()))
        self.status, self.kind, self.param, self.code = status, kind, param, code or kind

    @property
    def message(self) -> str:
        return str(self)

    def body(self, endpoint: str) -> dict:
        if endpoint == "messages":  # Anthropic's shape and error types
            kind = ANTHROPIC_TYPES.get(self.status, self.kind)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   429: "rate_limit_error",
                   503: "overloaded_error", 500: "api_error"}


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param)


def from_conversion(exc) -> HTTPError:
    """deepseek_recipe's ConversionError carries its status and an OpenAI-shaped body: keep both."""
    status = getattr(exc, "status_code", None) or 400
    message = str(exc)
    try:
        err = json.loads(exc.body)["error"]
        message, kind = err.get("message") or message, err.get("type") or "invalid_request_error"
    except Exception:
        kind = "invalid_request_error"
    return HTTPError(int(status), message, kind)


async def json_body(request: Request) -> dict:
    """The request's body as a JSON object, or a 400 saying what it is instead."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not JSON ({getattr(exc, 'msg', type(exc).__name__)})") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body is a JSON {type(body).__name__}; allowed: a JSON object")
    return body
