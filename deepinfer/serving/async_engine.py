"""AsyncEngine: the engine core behind an asyncio server.

The engine client (deepinfer/engine/client.py: add, abort, get) is not thread-safe (one zmq socket), so one
background thread owns it: it sends what the event loop queued (adds, aborts), waits briefly for the core's
outputs and hands each request's updates to that request's asyncio queue on the loop. Nothing on the event loop
ever blocks on the engine.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from deepinfer.engine.client import EngineDeadError, InprocClient
from deepinfer.engine.messages import AddRequest, RequestUpdate

log = logging.getLogger("deepinfer.serving")

POLL_S = 0.005  # how long one get() waits: bounds the delay a new request or abort sees before it is sent
IDLE_WAIT_S = 0.05  # an in-process core with no work: wait this long for a submission before stepping again


@dataclass
class EngineStream:
    """One request's updates, in order, as the pump thread delivered them."""

    request_id: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    arrival: float = field(default_factory=time.perf_counter)


class AsyncEngine:
    """client: an engine client (ProcessClient or InprocClient) already started; this object owns it from now on.
    seed: runtime.seed (requests without seq_seed draw with child_seed(seed, request id); None: a random seed).
    on_outputs(updates, stats, now): called on the pump thread for every batch (metrics)."""

    def __init__(self, client, seed: int | None = None, on_outputs=None):
        self.client = client
        self.info = client.info
        self.seed = seed
        self.on_outputs = on_outputs
        self.dead: str | None = None  # set when the core is gone: new requests are refused (503)
        self._ids = itertools.count()
        self._streams: dict[int, EngineStream] = {}
        self._outbox: collections.deque = collections.deque()  # ("add", AddRequest) | ("abort", id)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side -----------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._pump, name="deepinfer-engine-pump", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def submit(self, prompt_ids: list[int], params) -> EngineStream:
        """Queues one request; its updates arrive on the returned stream's queue (the last one has
        finish_reason set). Must be called on the event loop."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        rid = next(self._ids)
        stream = self._streams[rid] = EngineStream(rid)
        msg = AddRequest(request_id=rid, prompt_ids=list(prompt_ids), params=params, seed=self._seed(params, rid))
        self._outbox.append(("add", msg))
        self._wake.set()
        return stream

    def abort(self, stream: EngineStream) -> None:
        """Stops a request that is still running (a client that went away); its cache is freed by the core."""
        if not stream.finished and stream.request_id in self._streams:
            self._outbox.append(("abort", stream.request_id))
            self._wake.set()

    def _seed(self, params, rid: int) -> int:
        from deepinfer.sampling import child_seed, request_seed

        if params.seq_seed is None and self.seed is not None:
            return child_seed(self.seed, rid)
        return request_seed(params.seq_seed)

    def _deliver(self, updates: list[RequestUpdate]) -> None:
        for upd in updates:
            stream = self._streams.get(upd.request_id)
            if stream is None:
                continue
            if upd.finish_reason is not None:
                stream.finished = True
                del self._streams[upd.request_id]
            stream.queue.put_nowait(upd)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            self._deliver([RequestUpdate(request_id=rid, finish_reason="error", error=message)])

    # ---- pump thread ---------------------------------------------------------------------------------------
    def _pump(self) -> None:
        inproc = isinstance(self.client, InprocClient)
        try:
            while not self._stop.is_set():
                self._send_outbox()
                out = self.client.get(timeout=POLL_S)
                if out is None:
                    if inproc:  # get() returned at once: wait for work instead of spinning
                        self._wake.wait(IDLE_WAIT_S)
                        self._wake.clear()
                    continue
                if self.on_outputs is not None:
                    self.on_outputs(out.updates, out.stats, time.perf_counter())
                if out.updates:
                    self._loop.call_soon_threadsafe(self._deliver, list(out.updates))
        except EngineDeadError as exc:
            self._dead(str(exc).splitlines()[0] if str(exc) else "the engine core died")
        except Exception as exc:  # a bug here must not leave requests waiting forever
            log.exception("engine pump failed")
            self._dead(f"the engine frontend failed: {type(exc).__name__}: {exc}")

    def _send_outbox(self) -> None:
        adds, aborts = [], []
        while self._outbox:
            kind, item = self._outbox.popleft()
            (adds if kind == "add" else aborts).append(item)
        if adds:
            self.client.add(adds)
        if aborts:
            self.client.abort(aborts)

    def _dead(self, message: str) -> None:
        self.dead = message
        log.error("engine stopped: %s", message)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, message)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the pump, then the engine core (process killed and reaped if it does not stop in seconds)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.client.close()
