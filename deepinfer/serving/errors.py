"""HTTP errors of the server: one line of text, the protocol's error shape, never a traceback.

A request the server cannot run is the client's error (400, 404 for an unknown model, 413 for a too-long prompt
is still 400 as OpenAI answers it), a full admission queue is 429, a dead or stopping engine is 503. Before a route
sees a request (serving/guard.py): a foreign Host header 400, an origin not allowed 403, a body too large 413, one
too slow to arrive 408, a body that is not application/json 415.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("deepinfer.serving")


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


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                   415: "invalid_request_error", 429: "rate_limit_error",
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


def unconvertible(exc: BaseException, endpoint: str) -> HTTPError:
    """A request body the conversion failed on in a way it does not name (an exception other than HTTPError): the
    client's bytes caused it, so it is a 400 with the exception's first line, logged as one warning line (no
    traceback) so that a converter bug still shows."""
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    log.warning("%s: a request could not be converted: %s: %s", endpoint, type(exc).__name__, text)
    return bad_request(f"the request could not be converted ({type(exc).__name__}: {text})")


def log_refusal(method: str, path: str, exc: HTTPError) -> None:
    """A client error is one line at INFO, never a traceback."""
    log.info("%s %s: %d %s", method, path, exc.status, exc.message[:300])
