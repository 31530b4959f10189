"""Connections: what one client can hold open, and faults of the listening socket that must never end the server.

- The open-file limit's soft value is raised to its hard value at start (vLLM does the same), and open connections
  are capped below it (serve.max_connections): one more is answered `503` with `Connection: close` and closed.
- A request's head (request line and headers) must arrive within serve.header_timeout seconds of the connection's
  opening or of the end of its previous response; a silent or slow sender (5 bytes/s) is cut off then. Idle
  keep-alive connections close after serve.keep_alive_timeout (uvicorn's own timer).
- accept() failing for lack of file descriptors (EMFILE, ENFILE, ENOBUFS, ENOMEM) is survived: asyncio's accept
  loop pauses the socket and retries a second later; the loop's exception handler here counts the failure and logs
  one line at most once a second, and nothing it does can raise (the default handler logs through the job log's
  file handler, which re-opened its file and raised EMFILE inside the event loop: the server died).
- One such failure ends the loop's accept burst. The stdlib selector loop (CPython before gh-151615's fix) kept
  calling accept() up to `backlog` times after it, each failure scheduling one more retry: with 2,000 connections
  over a 1024 open-file limit the server spun through ~25,000 failed accepts a second.
- The job log's file handlers are opened before the server starts, so logging needs no new descriptor later.

The counters appear in /metrics (serving/metrics.py).
"""

from __future__ import annotations

import errno
import logging
import resource
import sys
import time

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from deepinfer.config.errors import ConfigError
from deepinfer.serving.metrics import ConnectionCounters

log = logging.getLogger("deepinfer.serving")

MAX_DEFAULT_CONNECTIONS = 16384
RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
REFUSAL_BODY = (b'{"error": {"message": "the server holds its maximum of %d connections (serve.max_connections); '
                b'retry later", "type": "service_unavailable", "param": null, "code": "too_many_connections"}}')
REFUSED_LINGER_S = 1.0  # a refused connection is closed this long after its 503 (so the client can read it)
LOG_EVERY_S = 1.0


def raise_open_file_limit() -> int:
    """Raises the soft open-file limit to the hard one (when it can) and returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(configured: int | None, file_limit: int) -> int:
    """serve.max_connections, or its default: 3/4 of the open-file limit, at most MAX_DEFAULT_CONNECTIONS. A value
    at or above the open-file limit is a ConfigError (accept would fail before the cap answers)."""
    if configured is None:
        return max(1, min(file_limit * 3 // 4, MAX_DEFAULT_CONNECTIONS))
    if configured >= file_limit:
        raise ConfigError(f"serve.max_connections={configured} is out of range; allowed: below the open-file limit "
                          f"({file_limit}; raise it with `ulimit -n`), or null for {file_limit * 3 // 4}")
    return configured


def guarded_protocol(cap: int, header_timeout: float, counters: ConnectionCounters, base=AutoHTTPProtocol):
    """uvicorn's HTTP protocol class (h11 or httptools, as uvicorn picks) with the connection cap and the head
    timeout of this module."""

    class Guarded(base):
        def connection_made(self, transport):
            if len(self.connections) >= cap:  # the server state's set of open connections
                counters.add("connections_refused")
                self._refused = True
                self.transport = transport
                body = REFUSAL_BODY % cap
                transport.write(REFUSAL % (len(body), body))
                self.loop.call_later(REFUSED_LINGER_S, transport.close)
                return
            self._refused = False
            super().connection_made(transport)
            counters.open_connections = len(self.connections)
            self._head_timer = None
            self._await_head(None)

        def data_received(self, data):
            if not self._refused:
                super().data_received(data)

        def eof_received(self):
            if self._refused:
                return None
            return super().eof_received()

        def connection_lost(self, exc):
            if self._refused:
                return
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)
            counters.open_connections = len(self.connections)

        def on_response_complete(self):
            done = self.cycle
            super().on_response_complete()
            if self.cycle is done:  # no pipelined request started: the next head must come in time
                self._await_head(done)

        def _await_head(self, cycle):
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout, self._head_overdue, cycle)

        def _head_overdue(self, cycle):
            self._head_timer = None
            if self.cycle is cycle and not self.transport.is_closing():  # no new request's head arrived
                counters.add("header_timeouts")
                self.transport.close()

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


class _UntilResourceError:
    """A listening socket for one accept burst: once accept() has failed for lack of descriptors, it reports no
    connection waiting (BlockingIOError), which ends the stdlib loop's burst after its one retry is scheduled."""

    def __init__(self, sock):
        self.sock, self.failed = sock, False

    def accept(self):
        if self.failed:
            raise BlockingIOError
        try:
            return self.sock.accept()
        except OSError as exc:
            self.failed = exc.errno in RESOURCE_ERRNOS
            raise

    def __getattr__(self, name):  # fileno() and the rest: the socket's own
        return getattr(self.sock, name)


def end_accept_bursts_at_resource_errors(loop) -> None:
    """Makes `loop`'s accept bursts stop at the first failure for lack of descriptors (this module's docstring). A
    loop without the selector loop's `_accept_connection` (uvloop) is left as it is."""
    burst = getattr(loop, "_accept_connection", None)
    if burst is None or getattr(burst, "ends_at_resource_errors", False):
        return

    def accept_burst(protocol_factory, sock, *args, **kwargs):
        raw = sock.sock if isinstance(sock, _UntilResourceError) else sock  # the retry passes the wrapper back
        return burst(protocol_factory, _UntilResourceError(raw), *args, **kwargs)

    accept_burst.ends_at_resource_errors = True
    loop._accept_connection = accept_burst


def install_loop_guard(loop, counters: ConnectionCounters) -> None:
    """The event loop's exception handler: accept() out of descriptors is counted and logged (one line a second at
    most); anything else is logged as the default handler would. It never raises. Accept bursts end at the first
    such failure (end_accept_bursts_at_resource_errors)."""
    end_accept_bursts_at_resource_errors(loop)
    last = [0.0]

    def handler(loop, context):
        try:
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
                counters.add("accept_errors")
                now = time.monotonic()
                if now - last[0] >= LOG_EVERY_S:
                    last[0] = now
                    log.warning("accept() failed (%s): %d times so far; new connections wait (serve.max_connections"
                                " and the open-file limit bound them)", errno.errorcode.get(exc.errno, exc.errno),
                                counters.counts["accept_errors"])
                return
            loop.default_exception_handler(context)
        except BaseException:  # a log handler that cannot write must not take the event loop down
            try:
                sys.stderr.write(f"deepinfer: event-loop error: {context.get('message')}\n")
            except BaseException:
                pass

    loop.set_exception_handler(handler)


def open_log_files() -> None:
    """Opens the file handlers (Hydra's job log) that open their file lazily, so logging needs no new descriptor
    when descriptors run out."""
    for logger in [logging.getLogger(), *[logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]]:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.FileHandler) and handler.stream is None:
                try:
                    handler.stream = handler._open()
                except OSError:
                    pass
