"""Confidence-scheduled verification for DSpark (`DEEPINFER_ENABLE_MTP_VARLEN=1`): how many drafts each request
verifies this step.

Policy (behaviour of DeepInfer 0.1.0's `MTPVarlen`, FEATURES.md "DSpark", MODEL_V41_SPEC.md §6.4):

1. Every decode row carries its golden token; each draft position j of request i is a *slot* worth its cumulative
   acceptance rate r[i][j] = c[i][0]·…·c[i][j] (prefix products of the confidence head's outputs, see
   `cumulative_rates`): the expected number of extra tokens that verifying it yields.
2. The step's total size T (golden tokens + verified drafts) is chosen to maximise expected tokens per ms,
   (num_seqs + Σ of the T − num_seqs best slot rates) / step_ms(T), scanning T = num_seqs, num_seqs+1, … over the
   slots ranked by rate. step_ms(T) = curve(G) + slope·G + sampler_ms, where G is the smallest profiled size ≥ T (the
   CUDA graph that step would replay); sizes beyond the curve are never chosen; only a strictly better throughput
   moves the choice (so zero-rate slots and free-but-useless tokens are not taken).
3. The budget is computed from the rates two steps back (`rates_for_budget`), so an async scheduler can fix it
   before the previous step's confidences arrive; the T − num_seqs slots are then handed out from the freshest rates
   (`rates_for_alloc`) ranked by rate, ties by request index then position.
4. A request's slot j is only taken after its slot j − 1: rates are made non-increasing along a request (running
   minimum) before ranking, so ranking order is also prefix order.
5. `slope` corrects the start-up curve online for what it does not model (context length, load): the median over
   curve sizes of the per-size median of (forward_ms − curve(G)) / G over the last 5000 steps (a size counts once
   it has 10 samples), floored at 0; `sampler_ms` is the median of the last 9 sampler times for this batch size
   (once 5 are seen), else the same over all batch sizes, else 0.

The curve is profiled at start (`profile_cost_curve`) and cached on disk (`perf_cache_path`, `CostCurve.save/load`)
under `DEEPINFER_DECODE_PERF_CACHE_DIR`, keyed by everything that changes step time, with a TTL (DeepInfer: 1 h).

Pure Python: the scheduler imports this; nothing here touches torch or a device.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CostCurve",
    "VarlenPlanner",
    "cumulative_rates",
    "load_or_profile_cost_curve",
    "perf_cache_path",
    "profile_cost_curve",
]

_CACHE_FORMAT = 1


def cumulative_rates(confidences: Sequence[float]) -> list[float]:
    """Prefix products of per-position confidences: the probability that drafts 0..j all survive."""
    out: list[float] = []
    acc = 1.0
    for c in confidences:
        acc *= float(c)
        out.append(acc)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The cost curve: step time vs tokens in the step.


@dataclass
class CostCurve:
    """Measured decode step time (ms) at each profiled token count (the CUDA-graph sizes); a step of n tokens costs
    what the smallest profiled size ≥ n costs (it replays that graph); sizes past the last point are unpriced."""

    points: list[tuple[int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        pts = [(int(n), float(ms)) for n, ms in self.points]
        for k, (n, ms) in enumerate(pts):
            if n <= 0 or (k and n <= pts[k - 1][0]):
                raise ValueError(f"cost curve token counts must be positive and strictly increasing, got {pts}")
            if not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"cost curve times must be finite and > 0 ms, got {ms} at {n} tokens")
        self.points = pts

    def __len__(self) -> int:
        return len(self.points)

    @property
    def max_tokens(self) -> int:
        return self.points[-1][0] if self.points else 0

    def bucket(self, tokens: int) -> tuple[int, float] | None:
        """(graph size, ms) of the smallest profiled size ≥ tokens, or None when tokens is past the curve."""
        k = bisect.bisect_left(self.points, (tokens, -math.inf))
        return self.points[k] if k < len(self.points) else None

    def to_json(self) -> list[list[float]]:
        return [[n, ms] for n, ms in self.points]

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (unique temp file + rename), so concurrent engines never read half a file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        body = {"format": _CACHE_FORMAT, "saved_at": time.time(), "points": self.to_json()}
        try:
            with open(tmp, "w") as f:
                json.dump(body, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    @classmethod
    def load(cls, path: str | os.PathLike | None, ttl_s: float | None, now: float | None = None) -> CostCurve | None:
        """The curve saved at `path`, or None when there is none, it is unreadable/malformed, or it is older than
        `ttl_s` seconds (None = never expires). `now` (seconds since the epoch) is for tests."""
        if path is None:
            return None
        try:
            with open(path) as f:
                body = json.load(f)
            if body.get("format") != _CACHE_FORMAT:
                return None
            saved_at = float(body["saved_at"])
            curve = cls([(int(n), float(ms)) for n, ms in body["points"]])
        except (OSError, TypeError, ValueError, KeyError, AttributeError):
            return None
        now = time.time() if now is None else now
        if ttl_s is not None and now - saved_at > ttl_s:
            return None
        return curve if curve.points else None


def perf_cache_path(cache_dir: str | os.PathLike | None, key: dict[str, Any]) -> Path | None:
    """Where the curve for `key` lives under `cache_dir` (None: caching off). The key names everything that changes
    step time (model dir or hash, device name, dtype, the profiled sizes, parallel layout, draft length, ...); any
    change gives another file, i.e. a cache miss."""
    if not cache_dir:
        return None
    canon = json.dumps({"time_unit": "ms", "key": key}, sort_keys=True, separators=(",", ":"), default=str)
    return Path(cache_dir) / f"decode_perf_{hashlib.sha256(canon.encode()).hexdigest()}.json"


def profile_cost_curve(
    run_tokens: Callable[[int], None],
    sizes: Sequence[int],
    warmup: int = 1,
    repeats: int = 5,
    timer: Callable[[], float] | None = None,
) -> CostCurve:
    """Time `run_tokens(n)` (one decode step of n tokens) for every n in `sizes`, largest first as DeepInfer does.

    Each size: `warmup` untimed calls, then `repeats` timed ones; the fastest and slowest are dropped (when at least
    3 remain) and the median of the rest is the point. `timer()` returns seconds (default `time.perf_counter`); on a
    GPU pass one that synchronises the device first, or the times are launch times.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats} warmup={warmup}")
    timer = time.perf_counter if timer is None else timer
    ordered = sorted({int(n) for n in sizes})
    points: dict[int, float] = {}
    for n in reversed(ordered):
        for _ in range(warmup):
            run_tokens(n)
        times = []
        for _ in range(repeats):
            t0 = timer()
            run_tokens(n)
            times.append((timer() - t0) * 1e3)
        times.sort()
        if len(times) >= 3:
            times = times[1:-1]
        points[n] = _median(times)
    return CostCurve([(n, points[n]) for n in ordered])


def load_or_profile_cost_curve(
    cache_dir: str | os.PathLike | None,
    key: dict[str, Any],
    ttl_s: float | None,
    run_tokens: Callable[[int], None],
    sizes: Sequence[int],
    **profile_kwargs: Any,
) -> CostCurve:
    """The cached curve for `key` if fresh, else profile it now and cache it (when a cache dir is set)."""
    path = perf_cache_path(cache_dir, key)
    curve = CostCurve.load(path, ttl_s)
    if curve is not None and [n for n, _ in curve.points] == sorted({int(n) for n in sizes}):
        return curve
    curve = profile_cost_curve(run_tokens, sizes, **profile_kwargs)
    if path is not None:
        try:
            curve.save(path)
        except OSError:
            pass  # an unwritable cache only costs a re-profile next start
    return curve


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) * 0.5


# ---------------------------------------------------------------------------------------------------------------
# Online refinement of the curve.


class _WindowMedian:
    """Median of the last `window` values, known once `min_samples` were seen (sampler time per batch size)."""

    def __init__(self, window: int, min_samples: int) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._min = min_samples

    def update(self, value: float) -> None:
        self._values.append(value)

    def get(self) -> float | None:
        return _median(self._values) if len(self._values) >= self._min else None


class _SlopeEstimator:
    """Median over curve sizes of each size's median normalised residual, over the last `window` steps; a size
    contributes once it holds `min_samples` of them, and every contributing size weighs the same."""

    def __init__(self, window: int, min_samples: int) -> None:
        self._window: deque[tuple[int, float]] = deque()
        self._size = window
        self._min = min_samples
        self._by_graph: dict[int, list[float]] = {}  # each kept sorted

    def update(self, graph_size: int, residual: float) -> None:
        if len(self._window) == self._size:
            old_graph, old_value = self._window.popleft()
            values = self._by_graph[old_graph]
            del values[bisect.bisect_left(values, old_value)]
            if not values:
                del self._by_graph[old_graph]
        self._window.append((graph_size, residual))
        bisect.insort(self._by_graph.setdefault(graph_size, []), residual)

    def get(self) -> float:
        medians = [_median(v) for v in self._by_graph.values() if len(v) >= self._min]
        return _median(medians) if medians else 0.0


# ---------------------------------------------------------------------------------------------------------------
# The planner.


class VarlenPlanner:
    """Decides, each decode step, how many drafts each request verifies (see the module docstring)."""

    def __init__(
        self,
        curve: CostCurve,
        max_draft: int,
        *,
        slope_window: int = 5000,
        slope_min_samples: int = 10,
        sampler_window: int = 9,
        sampler_min_samples: int = 5,
    ) -> None:
        if max_draft < 0:
            raise ValueError(f"max_draft must be >= 0, got {max_draft}")
        self.curve = curve
        self.max_draft = max_draft
        self._slope = _SlopeEstimator(slope_window, slope_min_samples)
        self._sampler_by_num_seqs: dict[int, _WindowMedian] = {}
        self._sampler_window = (sampler_window, sampler_min_samples)
        self._sampler_all = _WindowMedian(sampler_window, sampler_min_samples)

    # -- runtime feedback -------------------------------------------------------------------------------------

    def update_runtime(self, num_seqs: int, tokens: int, forward_ms: float, sampler_ms: float = 0.0) -> None:
        """Feed a finished decode step's measured times: `tokens` = tokens in the step (golden + verified drafts),
        `forward_ms` = the forward's time, `sampler_ms` = the sampling/verification time after it. A step past the
        curve updates only the sampler estimate (there is no baseline to subtract)."""
        b = self.curve.bucket(tokens)
        if b is not None:
            graph_size, baseline_ms = b
            self._slope.update(graph_size, (float(forward_ms) - baseline_ms) / graph_size)
        est = self._sampler_by_num_seqs.get(num_seqs)
        if est is None:
            est = self._sampler_by_num_seqs[num_seqs] = _WindowMedian(*self._sampler_window)
        est.update(float(sampler_ms))
        self._sampler_all.update(float(sampler_ms))

    @property
    def slope_ms(self) -> float:
        """Extra ms per token of graph size the measured steps showed over the curve (never negative)."""
        return max(0.0, self._slope.get())

    def sampler_ms(self, num_seqs: int) -> float:
        est = self._sampler_by_num_seqs.get(num_seqs)
        value = est.get() if est is not None else None
        if value is None:
            value = self._sampler_all.get()
        return 0.0 if value is None else value

    def step_ms(self, tokens: int, num_seqs: int) -> float | None:
        """Estimated time of a step of `tokens` tokens over `num_seqs` requests; None when past the curve."""
        b = self.curve.bucket(tokens)
        if b is None:
            return None
        graph_size, baseline_ms = b
        return baseline_ms + self.slope_ms * graph_size + self.sampler_ms(num_seqs)

    # -- planning ---------------------------------------------------------------------------------------------

    def plan(
        self,
        rates_for_budget: Sequence[Sequence[float]],
        rates_for_alloc: Sequence[Sequence[float]],
        max_k: Sequence[int],
        has_draft: Sequence[bool] | None = None,
    ) -> list[int]:
        """Drafts to verify per request (k_i; the step is Σ(1 + k_i) tokens).

        Per request i: `rates_for_alloc[i]` are the cumulative acceptance rates of the drafts it holds now (latest
        confidences), `rates_for_budget[i]` the same from two steps back; `max_k[i]` caps how many it may verify
        (clipped to `max_draft`; 0 = none). Its slot count is min(max_k[i], len(rates_for_alloc[i])), or max_k[i]
        when that list is empty. An empty (or short) list means "not known yet" and is padded, as DeepInfer does,
        with 1.0 when the request has drafts and 0.0 when not; `has_draft[i]` says which (default: max_k[i] > 0,
        i.e. the caller passes max_k[i] = 0 for a request without drafts). A 0.0 slot is never verified.
        With an empty curve every slot is verified.
        """
        n = len(max_k)
        if len(rates_for_budget) != n or len(rates_for_alloc) != n or (has_draft is not None and len(has_draft) != n):
            raise ValueError("rates_for_budget, rates_for_alloc, max_k (and has_draft) need one entry per request")
        slots = []
        for i in range(n):
            cap = max(0, min(int(max_k[i]), self.max_draft))
            slots.append(min(cap, len(rates_for_alloc[i])) if len(rates_for_alloc[i]) else cap)
        drafted = [bool(has_draft[i]) if has_draft is not None else max_k[i] > 0 for i in range(n)]
        if n == 0:
            return []
        if not self.curve.points:
            return slots
        budget = self.choose_budget(
            [_slot_rates(rates_for_budget[i], slots[i], drafted[i]) for i in range(n)],
        )
        return self.allocate(budget, [_slot_rates(rates_for_alloc[i], slots[i], drafted[i]) for i in range(n)])

    def choose_budget(self, slot_rates: Sequence[Sequence[float]]) -> int:
        """How many draft slots to verify in total, given each request's slot rates (already padded/cut to its slot
        count): the count whose step maximises expected tokens per ms. 0 when even the golden tokens alone are past
        the curve (nothing can be priced, so nothing extra is risked)."""
        num_seqs = len(slot_rates)
        ranked = sorted(_ranked_slots(slot_rates), key=lambda s: (-s[0], s[1], s[2]))
        expected = float(num_seqs)
        best_tp, best_extra = 0.0, 0
        for extra in range(len(ranked) + 1):
            if extra:
                if ranked[extra - 1][0] <= 0.0:
                    break  # the rest rank lower: slots that gain nothing, however cheap a larger step looks
                expected += ranked[extra - 1][0]
            ms = self.step_ms(num_seqs + extra, num_seqs)
            if ms is None:
                break  # sizes only grow from here
            tp = expected / ms if ms > 0 else math.inf
            if tp > best_tp:
                best_tp, best_extra = tp, extra
        return best_extra

    @staticmethod
    def allocate(budget: int, slot_rates: Sequence[Sequence[float]]) -> list[int]:
        """Hand `budget` slots to the highest-ranked (request, position) slots (rate desc, then request, then
        position); returns drafts per request. Rates are made non-increasing per request first, so a request's
        slot j always ranks after its slot j − 1 and the result is a prefix of each request's drafts. A slot of
        rate 0 is never handed out, whatever the budget: the budget comes from older rates (`plan`), which may have
        promised more slots than the fresh ones hold."""
        counts = [0] * len(slot_rates)
        ranked = sorted(_ranked_slots(slot_rates), key=lambda s: (-s[0], s[1], s[2]))
        for rate, i, j in ranked[: max(0, budget)]:
            if rate <= 0.0:
                break  # the rest rank no higher
            assert j == counts[i], "slot ranking broke the prefix rule"
            counts[i] += 1
        return counts


def _slot_rates(rates: Sequence[float], slots: int, drafted: bool) -> list[float]:
    """The request's `slots` rates: its list cut to length, unknown tail padded with 1.0 (has drafts) or 0.0."""
    pad = 1.0 if drafted else 0.0
    return [float(rates[j]) if j < len(rates) else pad for j in range(slots)]


def _ranked_slots(slot_rates: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """(rate, request, position) for every slot, rates clamped to [0, 1] (NaN → 0) and made non-increasing."""
    out = []
    for i, rates in enumerate(slot_rates):
        running = 1.0
        for j, r in enumerate(rates):
            r = 0.0 if math.isnan(r) else min(1.0, max(0.0, r))
            running = min(running, r)
            out.append((running, i, j))
    return out
