"""The server's Prometheus metrics (GET /metrics, text format), in a registry of its own per server.

Request-side values (TTFT, inter-token latency, end-to-end latency, per-request token histograms) are updated by
the request handlers (event loop); engine-side values (queue time, cache use, prefix cache hits, preemptions, DSpark
drafts and accepted tokens, tokens/s) by the frontend's engine loop (deepinfer.frontend.AsyncEngine, on the event
loop) from each batch's RequestUpdates and StepStats. Every metric carries the served model's name as its
`model_name` label, as vLLM's do. prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
RATE_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def token_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's request-token buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ConnectionCounters:
    """What the connection layer refused or cut off (serving/connections.py, serving/guard.py); a collector of
    the server's registry."""

    NAMES = {"connections_refused": "Connections answered 503 at serve.max_connections",
             "header_timeouts": "Connections closed because a request head did not arrive in serve.header_timeout",
             "body_timeouts": "Requests answered 408: the body did not arrive in serve.body_timeout",
             "bodies_too_large": "Requests answered 413: the body was larger than serve.max_body_bytes",
             "accept_errors": "accept() failures for lack of file descriptors (EMFILE, ...), survived"}

    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.counts = collections.Counter({n: 0 for n in self.NAMES})
        self.open_connections = 0

    def add(self, name: str) -> None:
        self.counts[name] += 1

    def collect(self):
        gauge = GaugeMetricFamily("deepinfer_connections_open", "Open HTTP connections", labels=["model_name"])
        gauge.add_metric([self.model_name], self.open_connections)
        yield gauge
        for name, doc in self.NAMES.items():
            family = CounterMetricFamily(f"deepinfer_{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], self.counts[name])
            yield family


class PrefixCacheMetrics:
    """Prefix caching (docs/prefix-cache.md), a collector of the server's registry: prompt tokens looked up when
    requests were admitted and found cached (summed from each step's StepStats; vLLM's prefix_cache_queries /
    _hits), their ratio, and the engine's own counters as of its last step (blocks and checkpoints evicted since it
    started, what it holds now). All zero while prefix caching is off."""

    COUNTERS = {"evicted_blocks": "Cached blocks evicted for other sequences' blocks",
                "evicted_checkpoints": "Window checkpoints evicted for newer ones",
                "checkpoints_taken": "Window checkpoints written"}
    GAUGES = {"cached_blocks": "Blocks that hold a named prefix, held by a sequence or not",
              "checkpoints": "Window checkpoints held",
              "checkpoint_bytes": "Bytes held by window checkpoints"}

    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.queries = self.hits = 0
        self.last: dict = {}
        self._lock = threading.Lock()

    def on_step(self, stats) -> None:
        with self._lock:
            self.queries += stats.prefix_query_tokens
            self.hits += stats.prefix_hit_tokens
            if stats.prefix_cache is not None:
                self.last = dict(stats.prefix_cache)

    def collect(self):
        with self._lock:
            queries, hits, last = self.queries, self.hits, dict(self.last)
        families = [
            (CounterMetricFamily, "queries", "Prompt tokens looked up in the prefix cache at admission", queries),
            (CounterMetricFamily, "hits", "Prompt tokens found in the prefix cache at admission", hits),
            (GaugeMetricFamily, "hit_rate", "Prefix cache hits / queries since the server started",
             hits / queries if queries else 0.0)]
        families += [(CounterMetricFamily, k, doc, last.get(k, 0)) for k, doc in self.COUNTERS.items()]
        families += [(GaugeMetricFamily, k, doc, last.get(k, 0)) for k, doc in self.GAUGES.items()]
        for family_cls, name, doc, value in families:
            family = family_cls(f"deepinfer_prefix_cache_{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """model_name: the served name, the `model_name` label of every metric (vLLM's); max_model_len: the top of the
    request-token histograms."""

    def __init__(self, model_name: str = "", max_model_len: int = 1 << 20):
        r = self.registry = CollectorRegistry()
        label = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, label, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        self.model_name = model_name
        self.waiting = gauge("deepinfer_requests_waiting", "Requests accepted, no token generated yet (queue depth)")
        self.running = gauge("deepinfer_requests_running", "Requests generating tokens")
        self._requests = Counter("deepinfer_requests", "Finished requests by outcome", ["model_name", "finish_reason"],
                                 registry=r)
        self._rejected = Counter("deepinfer_requests_rejected", "Requests refused before the engine (HTTP status)",
                                 ["model_name", "status"], registry=r)
        self.prompt_tokens = counter("deepinfer_prompt_tokens", "Prompt tokens of submitted requests")
        self.generated_tokens = counter("deepinfer_generation_tokens", "Generated tokens")
        self.tokens_per_s = gauge("deepinfer_generation_tokens_per_second",
                                  f"Generated tokens per second over the last {RATE_WINDOW_S:g} s")
        self.ttft = histogram("deepinfer_time_to_first_token_seconds", "Arrival to first generated token",
                              TTFT_BUCKETS)
        self.itl = histogram("deepinfer_inter_token_latency_seconds", "Time between generated tokens", ITL_BUCKETS)
        self.e2e = histogram("deepinfer_e2e_request_latency_seconds", "Arrival to the request's end",
                             LATENCY_BUCKETS)
        self.queue_time = histogram("deepinfer_request_queue_time_seconds",
                                    "Arrival in the engine core to the first admission by its scheduler",
                                    QUEUE_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("deepinfer_request_prompt_tokens", "Prompt tokens per request", tokens)
        self.request_generation_tokens = histogram("deepinfer_request_generation_tokens",
                                                   "Generated tokens per request", tokens)
        self.draft_tokens = counter("deepinfer_spec_decode_num_draft_tokens", "DSpark draft tokens verified")
        self.accepted_tokens = counter("deepinfer_spec_decode_num_accepted_tokens", "DSpark draft tokens accepted")
        self.cache_use = gauge("deepinfer_cache_utilization", "Share of the cache blocks in use (last step)")
        self.preemptions = counter("deepinfer_preemptions", "Requests preempted (recomputed later)")
        self.steps = counter("deepinfer_engine_steps", "Engine steps")
        self.connections = ConnectionCounters(model_name)
        r.register(self.connections)
        self.prefix_cache = PrefixCacheMetrics(model_name)
        r.register(self.prefix_cache)
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
        self._requests.labels(self.model_name, reason).inc()

    def on_request_end(self, e2e_s: float, prompt_tokens: int, generated_tokens: int) -> None:
        """A request the engine ran (finished, stopped early or aborted): its latency and token counts."""
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)

    def on_rejected(self, status: int) -> None:
        self._rejected.labels(self.model_name, str(status)).inc()

    # ---- the engine loop (deepinfer.frontend.AsyncEngine) ------------------------------------------------
    def on_engine_outputs(self, updates, stats, now: float) -> None:
        tokens = 0
        for u in updates:
            tokens += len(u.token_ids)
            if u.queued_s is not None:
                self.queue_time.observe(u.queued_s)
        for s in stats:
            self.steps.inc()
            self.preemptions.inc(s.num_preempted)
            self.cache_use.set(s.cache_utilization)
            self.prefix_cache.on_step(s)
            if s.num_draft_tokens:
                self.draft_tokens.inc(s.num_draft_tokens)
                self.accepted_tokens.inc(s.num_accepted_tokens)
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
