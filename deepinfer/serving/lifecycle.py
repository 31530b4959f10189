"""The server's start and stop: the listening socket bound before the model loads, and the drain on SIGTERM.

Start: `bind(host, port)` opens the socket first, so a port in use (or a host that is not this machine's) costs one
line and exit code 2 before minutes of loading, and the socket uvicorn serves on is the one checked.

Stop (SIGTERM or Ctrl-C): `Drain.begin()` puts the server in draining mode: new requests get 503, the requests
already in flight run on. When none is left, or after serve.shutdown_timeout seconds, the drain `expires`: every
request still in the engine is aborted and ends in its protocol's error (a stream: an error event, then the
protocol's end marker such as `[DONE]`), and `on_done` is called (the server then stops uvicorn, whose connections
are idle by then). A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import errno
import socket

from deepinfer.config.errors import ConfigError

SHUTTING_DOWN = "the server is shutting down"
FINAL_WRITE_S = 2.0  # after the drain: seconds uvicorn gives connections to send their last bytes


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); ConfigError (one line) when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"serve.host={host!r} cannot be resolved ({exc.strerror}); allowed: an address or host "
                          "name of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may rebind at once
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            why = "is already in use"
        elif exc.errno == errno.EACCES:
            why = "needs privileges this process does not have"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = "is not an address of this machine"
        else:
            why = f"cannot be bound ({exc.strerror})"
        raise ConfigError(f"serve.port={port} on serve.host={host}: {host}:{port} {why}; allowed: a free port, or "
                          "serve.port=0 for any free port") from None
    sock.set_inheritable(True)
    return sock


class Drain:
    """Draining state of one server, on its event loop. engine: the AsyncEngine (its requests in flight and
    abort_all); timeout: serve.shutdown_timeout."""

    def __init__(self, engine, timeout: float):
        self.engine, self.timeout = engine, timeout
        self.draining = False  # new requests are refused (503)
        self.expired = False  # requests still running were aborted: they end in an error
        self._task: asyncio.Task | None = None

    def begin(self, on_done=None) -> None:
        """Starts draining (idempotent); `on_done()` once every request has ended."""
        if self.draining:
            return
        self.draining = True
        self._task = asyncio.get_running_loop().create_task(self._run(on_done), name="deepinfer-drain")

    def expire(self) -> None:
        """Ends every request still running now: each ends in its protocol's error ("shutting down")."""
        self.expired = True
        self.engine.abort_all()

    async def _run(self, on_done) -> None:
        if not await self._idle_within(self.timeout):
            self.expire()
            await self._idle_within(FINAL_WRITE_S)
        if on_done is not None:
            on_done()

    async def _idle_within(self, seconds: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.engine.num_in_flight:
            if loop.time() >= deadline:
                return False
            await self.engine.wait_for_change(deadline - loop.time())
        return True
