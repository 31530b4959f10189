"""CompileQueue: runs uninterruptible jobs (xgrammar compilations) on daemon threads, bounded in waiting, in time
from the moment each job starts, and in how many run at once, with a lane for light jobs that heavy ones cannot
block, several heavy lanes, and fairness between clients.

Why this shape (measured on the embedded tokenizer, 2-core VM): xgrammar 0.2.9 has no cancel, so a compile
cannot be stopped; moving it to a killable process would need its result serialized, and serialize_json costs
far more than compiling (10,000-value enum: 0.58 s to compile, 6.1 s and 97 MB to serialize; 100,000 values:
25 s vs 83 s and 1.15 GB). So jobs run on threads (xgrammar releases the GIL), and what cannot be cancelled is
contained instead:
- lanes: a job goes to the light lane when its cost (schema bytes) is at most `light_cost`, else to the heavy
  lanes; the light lane has its own worker, so any number of heavy schemas leave light ones an idle worker;
- clients (the server tags each job with who sent it; the offline API is one client, ""): each lane serves its
  clients round-robin, and one client runs at most `heavy_lanes - 1` heavy jobs at once (at least 1), so one
  client's heavy schemas always leave a heavy lane to the others. A named client may have at most
  `max_per_client` jobs waiting or running in a lane, and at most `max_queued` named clients' jobs wait in all;
  beyond either, submit raises ClientBusy (the server answers 429). The offline client's own batch is never
  refused for load: the caller submitted it all and waits for all of it;
- the timeout runs from the moment the job starts, never from submission; a job that finishes late is a timeout
  too (deterministic, whatever the scheduler's timing). On timeout the job's thread is abandoned (its result will be
  dropped; its client keeps the lane's share until it really ends) and the lane starts a fresh worker, unless
  `max_abandoned` threads are still running, which caps the compilations alive at once (and so their memory) at
  the lanes' workers + max_abandoned;
- a job whose owner has gone (`alive()` false, e.g. the request was aborted) is skipped when its turn comes;
- `heavy_room()` (optional): a heavy job starts only while it returns True (the pool's bound on the bytes of heavy
  grammars alive); whoever frees room calls `wake()`. Waiting for room is waiting for a turn: the timeout has
  not started;
- threads are daemons: closing (and interpreter exit) never waits for a compilation.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Callable


class ClientBusy(Exception):
    """Refused for load (the same job may be taken later), not for what it asks."""


QueueFull = ClientBusy  # the global bound on waiting jobs is the same kind of refusal


class _Job:
    __slots__ = ("fn", "result", "alive", "client", "lane", "started", "thread")

    def __init__(self, fn, result: Future, alive, client: str, lane: "_Lane"):
        self.fn, self.result, self.alive, self.client, self.lane = fn, result, alive, client, lane
        self.started: float | None = None
        self.thread: threading.Thread | None = None


class _Lane:
    def __init__(self, name: str, size: int):
        self.name, self.size = name, size
        self.per_client_running = max(1, size - 1)  # one lane left for the other clients
        self.waiting: collections.OrderedDict[str, collections.deque[_Job]] = collections.OrderedDict()
        self.running: collections.Counter[str] = collections.Counter()  # abandoned jobs included
        self.workers = 0  # threads serving this lane (not counting abandoned ones)
        self.busy = 0  # of those, the ones running a job
        self.room: Callable[[], bool] | None = None  # jobs start only while room() (None: always)

    def num_waiting(self, named_only: bool = False) -> int:
        return sum(len(q) for c, q in self.waiting.items() if c or not named_only)

    def pick(self) -> _Job | None:
        """The next job, round-robin over clients, skipping clients at their running share (lock held)."""
        if self.room is not None and self.waiting and not self.room():
            return None
        for client, queue in self.waiting.items():
            if self.running[client] < self.per_client_running:
                job = queue.popleft()
                if queue:
                    self.waiting.move_to_end(client)
                else:
                    del self.waiting[client]
                return job
        return None


class CompileQueue:
    """submit(fn, cost, alive, client) -> Future settled with fn()'s result, fn's exception, or on_timeout()'s
    exception; raises ClientBusy when the client (or the queue) is at its bound."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[], Exception], light_cost: int = 16 * 1024,
                 max_queued: int = 64, max_abandoned: int = 1, heavy_lanes: int = 2, max_per_client: int = 4,
                 heavy_room: Callable[[], bool] | None = None):
        if heavy_lanes < 1 or max_per_client < 1:
            raise ValueError(f"CompileQueue: heavy_lanes={heavy_lanes} and max_per_client={max_per_client} must "
                             "be >= 1")
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self.light_cost, self.max_queued, self.max_abandoned = light_cost, max_queued, max_abandoned
        self.max_per_client = max_per_client
        self._lanes = {"light": _Lane("light", 1), "heavy": _Lane("heavy", heavy_lanes)}
        self._lanes["heavy"].room = heavy_room
        self._lock = threading.Condition()
        self._running: dict[threading.Thread, _Job] = {}
        self._abandoned: set[threading.Thread] = set()
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="deepinfer-grammar-watchdog", daemon=True)
        self._watchdog.start()

    # ---- public ------------------------------------------------------------------------------------------------
    def submit(self, fn: Callable, cost: int, alive: Callable[[], bool] | None = None, client: str = "") -> Future:
        result: Future = Future()
        result.set_running_or_notify_cancel()
        lane = self._lanes["light" if cost <= self.light_cost else "heavy"]
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile queue is closed")
            if client:
                mine = len(lane.waiting.get(client, ())) + lane.running[client]
                if mine >= self.max_per_client:
                    raise ClientBusy(f"this client already has {mine} {lane.name} grammar compilations waiting or "
                                     f"running; allowed: at most {self.max_per_client} at once")
                if sum(ln.num_waiting(named_only=True) for ln in self._lanes.values()) >= self.max_queued:
                    raise ClientBusy(f"grammar compilation queue is full: {self.max_queued} compilations are "
                                     "already waiting")
            lane.waiting.setdefault(client, collections.deque()).append(_Job(fn, result, alive, client, lane))
            self._staff(lane)
            self._lock.notify_all()
        return result

    @property
    def num_running(self) -> int:
        """Compilations alive, abandoned ones included: what the memory bound is about."""
        with self._lock:
            return len(self._running)

    def wake(self) -> None:
        """Room may have been freed (heavy_room): waiting workers look again. Safe from any thread, also from a
        finalizer that runs while this thread holds the queue's lock (the lock is re-entrant)."""
        with self._lock:
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                for queue in lane.waiting.values():
                    for job in queue:
                        _settle(job.result, error=RuntimeError("the engine is shutting down"))
                lane.waiting.clear()
            self._lock.notify_all()

    # ---- workers -----------------------------------------------------------------------------------------------
    def _staff(self, lane: _Lane) -> None:
        """Starts workers for the lane up to its size while more jobs wait than it has idle workers, and the
        abandoned threads leave room (lock held). Idle, not all: a job waiting beside a running one needs a worker
        of its own (client b's one heavy schema used to wait for client a's to finish, the second lane unused)."""
        while (lane.workers < lane.size and lane.workers - lane.busy < lane.num_waiting()
               and len(self._abandoned) <= self.max_abandoned):
            lane.workers += 1
            threading.Thread(target=self._work, args=(lane,), name=f"deepinfer-grammar-{lane.name}",
                             daemon=True).start()

    def _work(self, lane: _Lane) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                job = None
                while not self._closed and (job := lane.pick()) is None:
                    self._lock.wait()
                if self._closed:
                    lane.workers -= 1
                    return
                if job.alive is not None and not job.alive():
                    _settle(job.result, error=RuntimeError("cancelled: the request has ended"))
                    continue
                job.started, job.thread = time.monotonic(), me
                lane.busy += 1
                lane.running[job.client] += 1
                self._running[me] = job
                self._lock.notify_all()  # the watchdog learns a deadline
            value, error = None, None
            try:
                value = job.fn()
            except BaseException as exc:  # noqa: BLE001 - reported through the future
                error = exc
            late = time.monotonic() - job.started >= self.timeout_s
            with self._lock:
                del self._running[me]
                if me not in self._abandoned:  # an abandoned thread stopped counting as the lane's when it overran
                    lane.busy -= 1
                lane.running[job.client] -= 1
                if lane.running[job.client] <= 0:
                    del lane.running[job.client]
                if late:
                    _settle(job.result, error=self._on_timeout())
                else:
                    _settle(job.result, value=value, error=error)
                # An idle worker must not keep its last result alive: a heavy grammar is tens of MB, freed (and the
                # heap trimmed) only when its request drops the last reference.
                value = error = job = None
                self._lock.notify_all()  # the client's next job may start now
                if me in self._abandoned:  # a fresh worker took over the lane meanwhile
                    self._abandoned.discard(me)
                    for other in self._lanes.values():
                        self._staff(other)  # room again under max_abandoned
                    return

    def _watch(self) -> None:
        """Ends overdue jobs' requests and hands their lanes to fresh workers."""
        while True:
            with self._lock:
                if self._closed and not self._running:
                    return
                now = time.monotonic()
                deadlines = [j.started + self.timeout_s for t, j in self._running.items() if t not in self._abandoned]
                for thread, job in list(self._running.items()):
                    if thread in self._abandoned or now < job.started + self.timeout_s:
                        continue
                    _settle(job.result, error=self._on_timeout())
                    self._abandoned.add(thread)
                    job.lane.workers -= 1
                    job.lane.busy -= 1
                    self._staff(job.lane)
                job = None  # nor may the watchdog, waiting, keep the last job it looked at (and its result)
                pending = [d for d in deadlines if d > now]
                self._lock.wait(timeout=(min(pending) - now) if pending else None)


def _settle(result: Future, value=None, error: BaseException | None = None) -> None:
    if result.done():  # the watchdog already ended it
        return
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(value)
