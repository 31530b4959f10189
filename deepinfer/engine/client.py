"""How the frontend reaches the engine core: in another process over zmq, or in this process (tests, debugging).

Both clients offer the same three calls: add(requests), abort(ids), get(timeout) -> CoreOutputs | None.
"""

from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import time
import weakref

import zmq

from deepinfer.engine.core import EngineCore
from deepinfer.engine.ipc import PrivateEndpoints, make_socket
from deepinfer.engine.messages import AddRequest, CoreInfo, CoreOutputs
from deepinfer.engine.options import EngineOptions


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed, or failed to start)."""


class InprocClient:
    """The core lives in this process; `get` runs one engine step."""

    def __init__(self, factory, options: EngineOptions):
        self.core = EngineCore(factory, options)
        self.info: CoreInfo = self.core.info()
        self._immediate = []

    def add(self, requests: list[AddRequest]) -> None:
        self._immediate += [u for u in map(self.core.add_request, requests) if u is not None]

    def abort(self, request_ids: list[int]) -> None:
        self._immediate += [u for u in map(self.core.abort, request_ids) if u is not None]

    def get(self, timeout: float | None = None) -> CoreOutputs | None:
        out = self.core.step() if self.core.has_work() else CoreOutputs([])
        if self._immediate:
            out.updates[:0], self._immediate = self._immediate, []
        return out if out.updates or out.stats else None

    def close(self) -> None:
        self.core.close()


class ProcessClient:
    """Spawns the engine core in its own process and talks to it over private ipc sockets."""

    def __init__(self, factory, options: EngineOptions):
        self.options = options
        self._closed = False
        self._dead: str | None = None
        self._endpoints = PrivateEndpoints()
        self._ctx = zmq.Context()
        self._send = make_socket(self._ctx, zmq.PUSH, self._endpoints.to_core, bind=True)
        self._recv = make_socket(self._ctx, zmq.PULL, self._endpoints.from_core, bind=True)
        args = (factory, options, self._endpoints.to_core, self._endpoints.from_core, os.getpid())
        payload = pickle.dumps(args)  # fails here, clearly, for a factory that cannot cross processes
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.engine.core_process"], stdin=subprocess.PIPE, close_fds=True
        )
        self.process.stdin.write(payload)
        self.process.stdin.close()
        # Close on interpreter exit even when the user forgets; a weakref keeps atexit from pinning us alive.
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close()
        atexit.register(self._atexit)
        try:
            kind, payload = self._wait(options.startup_timeout_s, what="start")
        except BaseException:
            self.close()
            raise
        if kind != "ready":
            self.close()
            raise EngineDeadError(f"the engine core failed to start:\n{payload}")
        self.info: CoreInfo = payload
        # A round trip proves both connections are up; established Unix-socket connections outlive their paths,
        # so the directory can go now and nothing is left on disk even if this process is killed later.
        self._send.send_pyobj(("ping", None))
        kind, _ = self._wait(options.startup_timeout_s, what="start")
        if kind != "pong":
            self.close()
            raise EngineDeadError(f"the engine core answered {kind!r} to its first ping")
        self._endpoints.remove()

    def add(self, requests: list[AddRequest]) -> None:
        self._check_alive()
        self._send.send_pyobj(("add", requests))

    def abort(self, request_ids: list[int]) -> None:
        self._check_alive()
        self._send.send_pyobj(("abort", request_ids))

    def get(self, timeout: float | None = None) -> CoreOutputs | None:
        kind, payload = self._wait(timeout, what="answer")
        if kind is None:
            return None
        if kind == "fatal":
            self._mark_dead(f"the engine core failed:\n{payload}")
        return payload

    def _wait(self, timeout: float | None, what: str):
        """Waits for one message, checking every liveness_poll_s that the engine process still runs."""
        self._check_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slice_s = self.options.liveness_poll_s
            if deadline is not None:
                slice_s = max(0.0, min(slice_s, deadline - time.monotonic()))
            if self._recv.poll(int(slice_s * 1000)):
                return self._recv.recv_pyobj()
            if self.process.poll() is not None:
                self._mark_dead(
                    f"the engine core process (pid {self.process.pid}) exited with code {self.process.returncode} "
                    f"while the frontend waited for its {what}"
                )
            if deadline is not None and time.monotonic() >= deadline:
                if what == "start":
                    raise EngineDeadError(f"the engine core did not start within {timeout:.0f} s")
                return None, None

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the engine was closed")

    def _mark_dead(self, message: str) -> None:
        self._dead = message
        self.close()
        raise EngineDeadError(message)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        try:
            if self.process.poll() is None:
                try:
                    self._send.send_pyobj(("shutdown", None), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            for stop in (None, self.process.terminate, self.process.kill):
                if stop is not None and self.process.poll() is None:
                    stop()
                try:
                    self.process.wait(timeout=5)  # reaps it: no zombie left behind either
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:
            self._send.close()
            self._recv.close()
            self._ctx.term()
            self._endpoints.remove()
