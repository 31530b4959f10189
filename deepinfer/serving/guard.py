"""What every HTTP request passes before a route sees it (an ASGI wrapper, so streaming and disconnects pass through
untouched), in this order:

1. Host: a Host header outside serve.allowed_hosts is 400 (a DNS-rebinding guard: a web page whose name resolves to
   127.0.0.1 would otherwise reach a loopback server). Default: loopback names when the server listens on loopback.
2. Origin: a request carrying an Origin header outside serve.allowed_origins is 403; an allowed one gets CORS
   headers, and its preflight (OPTIONS) is answered 204. Requests without Origin (SDKs, curl) are not browsers'.
3. Content type: a POST whose body is not `application/json` is 415, so a page cannot run a request through a
   form or a `text/plain` fetch that the browser sends without asking the server first.
4. Body size and time: a Content-Length above serve.max_body_bytes is 413 before a byte of the body is read; a body
   without one (chunked) is counted as it arrives and cut at the limit (413); a body that has not arrived in full
   serve.body_timeout seconds after its head is 408. These answers close the connection.
5. Memory: once a request whose body was TRIM_AFTER_BODY_BYTES or more is answered, the heap is trimmed (off the
   loop's thread, sampling/heap_trim.py).

Each refusal is one line at INFO and a response in the protocol's error shape.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from deepinfer.sampling import heap_trim
from deepinfer.serving.auth import is_loopback
from deepinfer.serving.errors import HTTPError, log_refusal

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_MAX_AGE = "600"
# A body this large leaves its parse (a large schema: ~100k small objects) in freed heap pages that glibc keeps;
# once the request is answered the server asks for a trim (soak: the server kept +22 MB after a grammar flood's
# bodies without it, +16 MB with it).
TRIM_AFTER_BODY_BYTES = 256 << 10


@dataclass(frozen=True)
class GuardSettings:
    max_body_bytes: int
    body_timeout: float
    allowed_hosts: tuple[str, ...] | None  # None: any
    allowed_origins: tuple[str, ...]

    @classmethod
    def from_serve(cls, serve) -> "GuardSettings":
        """serve.allowed_hosts null: loopback names on a loopback server, any host on an exposed one."""
        hosts = serve.allowed_hosts
        if hosts is None:
            hosts = LOOPBACK_NAMES if is_loopback(serve.host) else None
        if hosts is not None and "*" in hosts:
            hosts = None
        return cls(serve.max_body_bytes, serve.body_timeout,
                   None if hosts is None else tuple(h.lower() for h in hosts), tuple(serve.allowed_origins))

    def host_allowed(self, host_header: str | None) -> bool:
        if self.allowed_hosts is None:
            return True
        if not host_header:
            return False  # HTTP/1.1 requires Host; without one the name cannot be checked
        name = host_header.strip().lower()
        if name.startswith("["):  # [::1]:8000
            name = name[1:].partition("]")[0]
        elif name.count(":") == 1:
            name = name.partition(":")[0]
        return name in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins


class Guard:
    """ASGI wrapper applying GuardSettings; `counters`: the server's ConnectionCounters (timeouts, refusals)."""

    def __init__(self, app, settings: GuardSettings, counters=None):
        self.app, self.settings, self.counters = app, settings, counters
        self.router = getattr(app, "router", None)  # what tests and uvicorn may look at stays reachable

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        path, method = scope.get("path", ""), scope.get("method", "GET")
        endpoint = "messages" if path.startswith("/v1/messages") else "chat"
        s = self.settings
        host = headers.get("host")
        if not s.host_allowed(host):
            allowed = ", ".join(s.allowed_hosts)
            return await self._refuse(scope, receive, send, endpoint, HTTPError(
                400, f"Host {str(host)[:100]!r} is not allowed; allowed: {allowed} (serve.allowed_hosts)",
                param="host", code="invalid_host"))
        origin = headers.get("origin")
        cors: list[tuple[bytes, bytes]] = []
        if origin is not None:
            if not s.origin_allowed(origin):
                allowed = ", ".join(s.allowed_origins) or "none"
                return await self._refuse(scope, receive, send, endpoint, HTTPError(
                    403, f"Origin {origin[:100]!r} is not allowed; allowed: {allowed} (serve.allowed_origins)",
                    "permission_error", param="origin", code="origin_not_allowed"))
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
            if method == "OPTIONS" and "access-control-request-method" in headers:
                asked = headers.get("access-control-request-headers", "")
                preflight = Response(status_code=204, headers={
                    "access-control-allow-methods": CORS_METHODS, "access-control-allow-headers": asked,
                    "access-control-max-age": CORS_MAX_AGE})
                return await _with_headers(preflight, cors)(scope, receive, send)
        if method == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return await self._refuse(scope, receive, send, endpoint, HTTPError(
                    415, f"Content-Type {kind or 'none'!r} is not accepted; allowed: application/json",
                    param="content-type", code="unsupported_media_type"), cors)
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > s.max_body_bytes:
                self._count("bodies_too_large")
                return await self._refuse(scope, receive, send, endpoint, _too_large(int(length), s), cors,
                                          close=True)
        state = _BodyState()
        try:
            await self.app(scope, self._receive(receive, state), _send(send, cors, state))
        finally:
            if state.received >= TRIM_AFTER_BODY_BYTES:
                heap_trim.request()

    def _receive(self, receive, state: "_BodyState"):
        """`receive` that counts the body and bounds the time it takes; a breach raises the HTTPError the route
        answers (its json_body reads through this) and marks the connection to be closed."""
        s = self.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.body_timeout

        async def guarded():
            if state.done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                state.close = True
                self._count("body_timeouts")
                raise HTTPError(408, f"the request body did not arrive within {s.body_timeout:g} s "
                                     "(serve.body_timeout); the connection is closed", code="request_timeout") from None
            if message["type"] != "http.request":
                state.done = True
                return message
            state.received += len(message.get("body", b""))
            if state.received > s.max_body_bytes:
                state.close = True
                self._count("bodies_too_large")
                raise _too_large(None, s)
            if not message.get("more_body", False):
                state.done = True
            return message

        return guarded

    async def _refuse(self, scope, receive, send, endpoint: str, exc: HTTPError, cors=(), close: bool = False):
        log_refusal(scope.get("method", ""), scope.get("path", ""), exc)
        headers = [*cors] + ([(b"connection", b"close")] if close else [])
        await _with_headers(JSONResponse(exc.body(endpoint), status_code=exc.status), headers)(scope, receive, send)

    def _count(self, name: str) -> None:
        if self.counters is not None:
            self.counters.add(name)


class _BodyState:
    def __init__(self):
        self.received, self.done, self.close = 0, False, False


def _too_large(length: int | None, s: GuardSettings) -> HTTPError:
    size = f"is {length} bytes" if length is not None else "is longer"
    return HTTPError(413, f"the request body {size}; allowed: at most {s.max_body_bytes} bytes "
                          "(serve.max_body_bytes)", param="body", code="request_too_large")


def _send(send, cors, state: _BodyState):
    async def guarded(message):
        if message["type"] == "http.response.start" and (cors or state.close):
            extra = [*cors] + ([(b"connection", b"close")] if state.close else [])
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return guarded


def _with_headers(response, headers):
    for k, v in headers:
        response.headers.append(k.decode("latin-1"), v.decode("latin-1"))
    return response
