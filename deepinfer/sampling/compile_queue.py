"""CompileQueue: runs uninterruptible jobs (xgrammar compilations) on daemon threads, bounded in waiting, in time
from the moment each job starts, and in how many run at once, with a lane for light jobs that heavy ones
cannot block.

Why this shape (measured on the embedded tokenizer, 2-core VM): xgrammar 0.2.9 has no cancel, so a compile
cannot be stopped; moving it to a killable process would need its result serialized, and serialize_json costs
far more than compiling (10,000-value enum: 0.58 s to compile, 6.1 s and 97 MB to serialize; 100,000 values:
25 s vs 83 s and 1.15 GB). So jobs run on threads (xgrammar releases the GIL), and what cannot be cancelled is
contained instead:
- lanes: a job goes to the light lane when its cost (schema bytes) is at most `light_cost`, else the heavy lane;
  each lane has its own worker, so any number of heavy schemas leave light ones an idle worker;
- the timeout runs from the moment the job starts, never from submission; a job that finishes late is a timeout
  too (deterministic, whatever the scheduler's timing). On timeout the job's thread is abandoned (its result will be
  dropped) and the lane starts a fresh worker, unless `max_abandoned` threads are still running, which caps the
  compilations alive at once (and so their memory) at lanes + max_abandoned;
- the queue is bounded (`max_queued` waiting jobs, then an immediate error) and a job whose owner has gone
  (`alive()` false, e.g. the request was aborted) is skipped when its turn comes;
- threads are daemons: closing (and interpreter exit) never waits for a compilation.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Callable


class QueueFull(Exception):
    pass


class _Job:
    __slots__ = ("fn", "result", "alive", "started", "thread")

    def __init__(self, fn, result: Future, alive):
        self.fn, self.result, self.alive = fn, result, alive
        self.started: float | None = None
        self.thread: threading.Thread | None = None


class _Lane:
    def __init__(self, name: str):
        self.name = name
        self.waiting: collections.deque[_Job] = collections.deque()
        self.workers = 0  # threads serving this lane (not counting abandoned ones)


class CompileQueue:
    """submit(fn, cost, alive) -> Future settled with fn()'s result, fn's exception, or on_timeout()'s exception."""

    def __init__(self, timeout_s: float, on_timeout: Callable[[], Exception], light_cost: int = 16 * 1024,
                 max_queued: int = 64, max_abandoned: int = 1):
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self.light_cost, self.max_queued, self.max_abandoned = light_cost, max_queued, max_abandoned
        self._lanes = {"light": _Lane("light"), "heavy": _Lane("heavy")}
        self._lock = threading.Condition()
        self._running: dict[threading.Thread, _Job] = {}
        self._abandoned: set[threading.Thread] = set()
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="deepinfer-grammar-watchdog", daemon=True)
        self._watchdog.start()

    # ---- public ------------------------------------------------------------------------------------------------
    def submit(self, fn: Callable, cost: int, alive: Callable[[], bool] | None = None) -> Future:
        result: Future = Future()
        result.set_running_or_notify_cancel()
        lane = self._lanes["light" if cost <= self.light_cost else "heavy"]
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile queue is closed")
            if sum(len(ln.waiting) for ln in self._lanes.values()) >= self.max_queued:
                raise QueueFull(f"{self.max_queued} compilations are already waiting")
            lane.waiting.append(_Job(fn, result, alive))
            self._staff(lane)
            self._lock.notify_all()
        return result

    @property
    def num_running(self) -> int:
        """Compilations alive, abandoned ones included: what the memory bound is about."""
        with self._lock:
            return len(self._running)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                while lane.waiting:
                    _settle(lane.waiting.popleft().result, error=RuntimeError("the engine is shutting down"))
            self._lock.notify_all()

    # ---- workers -----------------------------------------------------------------------------------------------
    def _staff(self, lane: _Lane) -> None:
        """Starts a worker for the lane if it has none and the abandoned threads leave room (lock held)."""
        if lane.workers == 0 and lane.waiting and len(self._abandoned) <= self.max_abandoned:
            lane.workers += 1
            threading.Thread(target=self._work, args=(lane,), name=f"deepinfer-grammar-{lane.name}",
                             daemon=True).start()

    def _work(self, lane: _Lane) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while not lane.waiting and not self._closed:
                    self._lock.wait()
                if self._closed:
                    lane.workers -= 1
                    return
                job = lane.waiting.popleft()
                if job.alive is not None and not job.alive():
                    _settle(job.result, error=RuntimeError("cancelled: the request has ended"))
                    continue
                job.started, job.thread = time.monotonic(), me
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
                if late:
                    _settle(job.result, error=self._on_timeout())
                else:
                    _settle(job.result, value=value, error=error)
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
                    lane = next(ln for ln in self._lanes.values() if thread.name.endswith(ln.name))
                    lane.workers -= 1
                    self._staff(lane)
                pending = [d for d in deadlines if d > now]
                self._lock.wait(timeout=(min(pending) - now) if pending else None)


def _settle(result: Future, value=None, error: BaseException | None = None) -> None:
    if result.done():  # the watchdog already ended it
        return
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(value)
