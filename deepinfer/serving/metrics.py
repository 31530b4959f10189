"""The server's Prometheus metrics (GET /metrics, text format), in a registry of its own per server.

Request-side values are updated by the request handlers (event loop); engine-side values (cache use, preemptions,
tokens/s) by the frontend's engine loop (deepinfer.frontend.AsyncEngine, on the event loop) from each step's StepStats. prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("deepinfer_requests_waiting", "Requests accepted, no token generated yet (queue depth)",
                             registry=r)
        self.running = Gauge("deepinfer_requests_running", "Requests generating tokens", registry=r)
        self.requests = Counter("deepinfer_requests", "Finished requests by outcome", ["finish_reason"], registry=r)
        self.rejected = Counter("deepinfer_requests_rejected", "Requests refused before the engine (HTTP status)",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of submitted requests", registry=r)
        self.generated_tokens = Counter("deepinfer_generation_tokens", "Generated tokens", registry=r)
        self.tokens_per_s = Gauge("deepinfer_generation_tokens_per_second",
                                  f"Generated tokens per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("deepinfer_inter_token_latency_seconds", "Time between generated tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.cache_use = Gauge("deepinfer_cache_utilization", "Share of the cache blocks in use (last step)",
                               registry=r)
        self.preemptions = Counter("deepinfer_preemptions", "Requests preempted (recomputed later)", registry=r)
        self.steps = Counter("deepinfer_engine_steps", "Engine steps", registry=r)
        self._window: collections.deque = collections.deque()  # (time, tokens) of recent engine outputs
        self._lock = threading.Lock()

    # ---- request handlers (event loop) ---------------------------------------------------------------------
    def on_submit(self, num_prompt_tokens: int) -> None:
        self.waiting.inc()
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.waiting.dec()
        self.running.inc()

    def on_tokens_gap(self, gap_s: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(gap_s)

    def on_generated(self, n: int) -> None:
        self.generated_tokens.inc(n)

    def on_finish(self, reason: str, started: bool) -> None:
        (self.running if started else self.waiting).dec()
        self.requests.labels(reason).inc()

    def on_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    # ---- the engine loop (deepinfer.frontend.AsyncEngine) ------------------------------------------------
    def on_engine_outputs(self, updates, stats, now: float) -> None:
        tokens = sum(len(u.token_ids) for u in updates)
        for s in stats:
            self.steps.inc()
            self.preemptions.inc(s.num_preempted)
            self.cache_use.set(s.cache_utilization)
        with self._lock:
            self._window.append((now, tokens))
            self._rate(now)

    def _rate(self, now: float) -> None:
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            self._window.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._window) / RATE_WINDOW_S)

    def render(self) -> bytes:
        with self._lock:
            self._rate(time.perf_counter())
        return generate_latest(self.registry)
