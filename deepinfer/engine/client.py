"""How the frontend reaches the engine core: in another process over zmq, or in this process (tests, debugging).

Both clients offer the same three calls: add(requests), abort(ids), get(timeout) -> CoreOutputs | None.
"""

from __future__ import annotations

import atexit
import collections
import os
import subprocess
import sys
import time
import weakref

import logging

import zmq

from deepinfer.engine.core import EngineCore
from deepinfer.engine import messages as m
from deepinfer.engine import startup
from deepinfer.engine.ipc import CORE, FRONTEND, HEARTBEAT, PrivateEndpoints, Signer, Verifier, make_socket, new_key
from deepinfer.engine.messages import AddRequest, CoreInfo, CoreOutputs
from deepinfer.engine.options import EngineOptions


log = logging.getLogger("deepinfer.engine")


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (crashed, killed, hung, or failed to start). The message is one line;
    `details` holds the core's traceback when it sent one."""

    def __init__(self, message: str, details: str | None = None):
        super().__init__(message)
        self.details = details


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
    """Spawns the engine core in its own process and talks to it over private, signed ipc sockets (ipc.py), in
    the typed messages of messages.py. `factory` must be a typed description (startup.describe:
    SettingsBackend(settings)): the core is started from data, never from a pickled callable.

    Every wait is bounded: the frontend polls in slices of liveness_poll_s and between them checks that the core
    process exists, that its heartbeat is fresh (heartbeat_timeout_s) and that its step loop is turning
    (step_timeout_s); sends
    time out after send_timeout_s. Any of these raises EngineDeadError naming what happened, and close() never
    waits on the core for more than a few seconds (it kills it)."""

    def __init__(self, factory, options: EngineOptions, env: dict[str, str] | None = None):
        """env: the core process's environment (None: this one's), e.g. a data-parallel rank's RANK / MASTER_PORT."""
        self.options = options
        self._closed = False
        self._dead: str | None = None
        self._core_id: bytes | None = None  # the control connection whose messages verified
        self._inbox: collections.deque = collections.deque()
        self._last_beat: float | None = None  # monotonic time the newest heartbeat was sent
        self._loop_age: float | None = None
        self.dropped_frames = 0  # frames from a peer that does not hold the key, or not a message (never decoded)
        spec = startup.describe(factory)  # a factory with no typed description fails here, before any process
        key = new_key()
        self._signer = Signer(key, FRONTEND)
        self._verifier, self._beats = Verifier(key, CORE, m.TO_FRONTEND), Verifier(key, HEARTBEAT, m.HEARTBEAT)
        self._endpoints = PrivateEndpoints()
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER, self._endpoints.control, bind=True,
                                 send_timeout_s=options.send_timeout_s)
        self._beat_sock = make_socket(self._ctx, zmq.PULL, self._endpoints.heartbeat, bind=True, conflate=True)
        payload = startup.encode(startup.CoreStartup(spec, options, self._endpoints.control, self._endpoints.heartbeat,
                                                     key, os.getpid()))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.engine.core_process"], stdin=subprocess.PIPE, close_fds=True, env=env
        )
        self.process.stdin.write(payload)
        self.process.stdin.close()
        # Close on interpreter exit even when the user forgets; a weakref keeps atexit from pinning us alive.
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close()
        atexit.register(self._atexit)
        try:
            self._start(options.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        # Established Unix-socket connections outlive their paths: remove the directory now, so nothing is left on
        # disk even if this process is killed later, and nobody else can connect from here on.
        self._endpoints.remove()

    def _start(self, timeout: float) -> None:
        msg = self._wait(timeout, what="start")
        if isinstance(msg, m.Failure):
            raise EngineDeadError(f"the engine core failed to start: {msg.line}", msg.details)
        if not isinstance(msg, m.Ready):
            raise EngineDeadError(f"the engine core sent {type(msg).__name__} before it was ready")
        self.info: CoreInfo = msg.info
        self._last_beat = time.monotonic()  # the heartbeat deadline runs from here (loading may take long)
        self._send(m.Ping())  # a round trip proves both directions are up
        msg = self._wait(timeout, what="start")
        if not isinstance(msg, m.Pong):
            raise EngineDeadError(f"the engine core answered {type(msg).__name__} to its first ping")

    def add(self, requests: list[AddRequest]) -> None:
        self._send(m.to_wire(requests))

    def abort(self, request_ids: list[int]) -> None:
        self._send(m.Abort(list(request_ids)))

    def get(self, timeout: float | None = None) -> CoreOutputs | None:
        msg = self._wait(timeout, what="answer")
        if msg is None:
            return None
        if isinstance(msg, m.Failure):
            self._mark_dead(f"the engine core failed: {msg.line}", msg.details)
        if not isinstance(msg, m.Outputs):
            log.warning("ignored a %s message from the engine core while waiting for outputs", type(msg).__name__)
            return None
        return msg.outputs

    def _send(self, msg) -> None:
        self._check_alive()
        self._pump()
        self._check_alive()
        try:
            self._sock.send_multipart([self._core_id, self._signer.pack(msg)])
        except zmq.Again:
            self._mark_dead(f"the engine core (pid {self.process.pid}) did not take a message within "
                            f"{self.options.send_timeout_s:g} s")
        except zmq.ZMQError as exc:  # EHOSTUNREACH: its connection is gone
            self._mark_dead(f"the engine core (pid {self.process.pid}) is unreachable ({exc})")

    def _pump(self) -> None:
        """Takes every message waiting on the sockets without blocking: heartbeats update the liveness state,
        the core's messages queue in self._inbox; anything unsigned is dropped."""
        while True:
            try:
                frame = self._beat_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            beat = self._beats.unpack(frame)
            if beat is not None:
                self._last_beat, self._loop_age = beat.sent, beat.loop_age
        while True:
            try:
                ident, frame = self._sock.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                break
            except ValueError:
                continue  # a peer that sent an empty message
            if self._core_id is not None and ident != self._core_id:
                self.dropped_frames += 1  # another connection: not ours, whatever it sends
                continue
            msg = self._verifier.unpack(frame)
            if msg is None:
                self.dropped_frames += 1
                continue
            if self._core_id is None:
                self._core_id = ident
            if not isinstance(msg, m.Hello):
                self._inbox.append(msg)

    def _wait(self, timeout: float | None, what: str):
        """Waits for one message from the core, checking between slices that it is alive and not hung."""
        self._check_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._pump()
            if self._inbox:
                return self._inbox.popleft()
            self._check_health(what)
            slice_s = self.options.liveness_poll_s
            if deadline is not None:
                slice_s = max(0.0, min(slice_s, deadline - time.monotonic()))
            zmq.select([self._sock, self._beat_sock], [], [], slice_s)
            if deadline is not None and time.monotonic() >= deadline and not self._pending_input():
                if what == "start":
                    raise EngineDeadError(f"the engine core did not start within {timeout:.0f} s")
                return None

    def heartbeat_age(self) -> float | None:
        """Seconds since the core's newest heartbeat was sent, as of the frontend's last look (it looks every
        liveness_poll_s while it waits); None before the core is ready. Any thread may read it."""
        beat = self._last_beat
        return None if beat is None else time.monotonic() - beat

    def _pending_input(self) -> bool:
        return bool(self._sock.poll(0))

    def _check_health(self, what: str) -> None:
        pid = self.process.pid
        if self.process.poll() is not None:
            self._mark_dead(
                f"the engine core process (pid {pid}) exited with code {self.process.returncode} "
                f"while the frontend waited for its {what}"
            )
        if what == "start" or self._last_beat is None:
            return  # still starting (loading may hold the GIL for long): startup_timeout_s bounds that
        limit = self.options.heartbeat_timeout_s
        silent = time.monotonic() - self._last_beat
        if silent > limit:
            self._mark_dead(f"the engine core (pid {pid}) sent no heartbeat for {silent:.0f} s (deadline "
                            f"{limit:g} s): it is stopped or hung")
        step_limit = self.options.step_timeout_s
        if self._loop_age is not None and self._loop_age > step_limit:
            self._mark_dead(f"the engine core's step loop (pid {pid}) has not turned for {self._loop_age:.0f} s "
                            f"(deadline {step_limit:g} s): it is hung")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the engine was closed")
        if self.process.poll() is not None:
            self._mark_dead(f"the engine core process (pid {self.process.pid}) exited with code "
                            f"{self.process.returncode}")

    def _mark_dead(self, message: str, details: str | None = None) -> None:
        self._dead = message
        self.close()
        raise EngineDeadError(message, details)

    def close(self) -> None:
        """Stops the core: asks it (if it is healthy), then SIGTERM, then SIGKILL; at most ~2 * close_grace_s."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        try:
            healthy = self._dead is None and self.process.poll() is None
            if healthy and self._core_id is not None:
                try:
                    self._sock.send_multipart([self._core_id, self._signer.pack(m.Shutdown())], zmq.NOBLOCK)
                except zmq.ZMQError:
                    healthy = False
            # A stopped (SIGSTOP) or hung core ignores both the message and SIGTERM: go straight to SIGKILL.
            steps = (None, self.process.terminate, self.process.kill) if healthy else (self.process.kill,)
            for stop in steps:
                if self.process.poll() is not None:
                    break
                if stop is not None:
                    stop()
                try:
                    self.process.wait(timeout=self.options.close_grace_s)  # reaps it: no zombie left behind
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:
            self._sock.close()
            self._beat_sock.close()
            self._ctx.term()
            self._endpoints.remove()
