"""Per-run metrics, folded on the frontend from request timings and the engine's per-step stats.

Definitions (all times in seconds):
- ttft: from the request's submission to the arrival of its first token; itl: between consecutive token arrivals
  of one request (a step returns one token per request, so this is the per-request step interval).
- prefill/decode tokens per second: tokens of that kind over the device time they used; a mixed step's device
  time is split between its prefill and decode tokens in proportion to their counts.
- graph_steps: decode steps whose forward replayed a captured CUDA graph (the rest ran eagerly); draft_graph_steps:
  steps whose DSpark drafting replayed one (greedy and sampled requests alike, on CUDA).
- speculative (DSpark): drafts verified and accepted, the acceptance rate, the mean accepted length (tokens a
  verifying request gains per step: accepted drafts + the target's own token, DeepInfer's figure) and the
  histogram of accepted drafts per verification (index m: m drafts accepted).
- prefix_cache (prefix caching on): prompt tokens looked up when requests were admitted and found cached, the hit
  rate, and the cache's counters after the last step (blocks evicted, checkpoints taken/evicted/held and bytes).
- step_gap: device idle time between the end of one step and the start of the next (engine-process clock).
- scheduling_share: Python bookkeeping (planning steps, folding in their samples, and the runner building batch
  inputs and sampler rows) over that plus the model and sampler time: the share of a synchronous step spent on
  bookkeeping. Async scheduling overlaps the planning part with the device instead of adding it to the step.
- kernels: the engine process's kernel counters as of its last step (cumulative since that process started, so
  they include warm-up): calls a kernel backend handed to the torch op, per kind and reason, and TileLang JIT
  compiles, disk-cache hits and the seconds spent in them (None until a TileLang kernel was requested).
"""

from __future__ import annotations

import time

from deepinfer.engine.messages import StepStats


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": 0.0 for p in ps} | {"mean": 0.0}
    s = sorted(values)
    out = {f"p{p}": s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] for p in ps}
    out["mean"] = sum(s) / len(s)
    return out


class RunMetrics:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.submitted: dict[int, float] = {}
        self.last_token: dict[int, float] = {}
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.steps: list[StepStats] = []
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.requests = 0
        self.errors = 0

    def on_submit(self, rid: int, num_prompt_tokens: int) -> None:
        self.submitted[rid] = time.perf_counter()
        self.prompt_tokens += num_prompt_tokens
        self.requests += 1

    def on_tokens(self, rid: int, n: int, now: float) -> float | None:
        """Returns the request's time to first token when these are its first tokens."""
        if n == 0:
            return None
        self.generated_tokens += n
        prev = self.last_token.get(rid)
        self.last_token[rid] = now
        if prev is None:
            ttft = now - self.submitted[rid]
            self.ttft.append(ttft)
            return ttft
        self.itl.append(now - prev)
        return None

    def on_finish(self, rid: int, reason: str) -> None:
        self.errors += reason == "error"

    def summary(self) -> dict:
        wall = time.perf_counter() - self.t0
        steps = sorted(self.steps, key=lambda s: s.step_id)
        pf_tok = sum(s.num_prefill_tokens for s in steps)
        dc_tok = sum(s.num_decode_tokens for s in steps)
        pf_time = dc_time = device = 0.0
        for s in steps:
            d = s.device_end - s.device_start
            device += d
            total = s.num_prefill_tokens + s.num_decode_tokens
            if total:
                pf_time += d * s.num_prefill_tokens / total
                dc_time += d * s.num_decode_tokens / total
        gaps = [b.device_start - a.device_end for a, b in zip(steps, steps[1:])]
        cpu = sum(s.schedule_s + s.update_s for s in steps)
        prep = sum(s.prepare_s for s in steps)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "wall_s": wall,
            "output_tokens_per_s": self.generated_tokens / wall if wall > 0 else 0.0,
            "prefill_tokens": pf_tok,
            "decode_tokens": dc_tok,
            "prefill_tokens_per_s": pf_tok / pf_time if pf_time > 0 else 0.0,
            "decode_tokens_per_s": dc_tok / dc_time if dc_time > 0 else 0.0,
            "ttft_s": percentiles(self.ttft),
            "itl_s": percentiles(self.itl),
            "preemptions": sum(s.num_preempted for s in steps),
            "steps": len(steps),
            "mixed_steps": sum(1 for s in steps if s.num_prefill_tokens and s.num_decode_tokens),
            "graph_steps": sum(1 for s in steps if s.graph),  # decode steps that replayed a captured CUDA graph
            "draft_graph_steps": sum(1 for s in steps if s.draft_graph),
            # YOCO compact: decoder-layer rows (rows x consumer layers) the prefill steps did not compute
            "replay_rows_saved": sum(s.replay_rows_saved for s in steps),
            "mean_rows_per_step": sum(s.num_rows for s in steps) / len(steps) if steps else 0.0,
            "device_busy_s": device,
            "step_gap_s": percentiles(gaps),
            "scheduling_cpu_s": cpu,
            "runner_prepare_s": prep,
            "scheduling_share": (cpu + prep) / (cpu + device) if cpu + device > 0 else 0.0,
            "kernels": steps[-1].kernels if steps else {"fallbacks": {}, "jit": None},
            "speculative": speculative_summary(steps),
            "prefix_cache": prefix_summary(steps),
            "cache_utilization": {
                "mean": sum(s.cache_utilization for s in steps) / len(steps) if steps else 0.0,
                "peak": max((s.cache_utilization for s in steps), default=0.0),
            },
        }


def prefix_summary(steps: list[StepStats]) -> dict | None:
    """Prefix caching over the run: tokens looked up at admission (queries) and found cached (hits), their
    ratio, and the cache's state after the last step (evictions and checkpoints since the engine started)."""
    last = next((s.prefix_cache for s in reversed(steps) if s.prefix_cache is not None), None)
    if last is None:
        return None
    queries = sum(s.prefix_query_tokens for s in steps)
    hits = sum(s.prefix_hit_tokens for s in steps)
    return {"query_tokens": queries, "hit_tokens": hits, "hit_rate": hits / queries if queries else 0.0,
            "evicted_blocks": last["evicted_blocks"], "checkpoints_taken": last["checkpoints_taken"],
            "evicted_checkpoints": last["evicted_checkpoints"], "cached_blocks": last["cached_blocks"],
            "checkpoints": last["checkpoints"], "checkpoint_bytes": last["checkpoint_bytes"]}


def speculative_summary(steps: list[StepStats]) -> dict | None:
    lengths = [m for s in steps for m in getattr(s, "accepted_lengths", ())]
    if not lengths:
        return None
    drafts = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_tokens for s in steps)
    hist = [0] * (max(lengths) + 1)
    for m in lengths:
        hist[m] += 1
    return {"draft_tokens": drafts, "accepted_tokens": accepted, "acceptance_rate": accepted / drafts if drafts else 0.0,
            "verifications": len(lengths), "mean_accepted_length": 1 + accepted / len(lengths), "histogram": hist}


def kernel_lines(kernels: dict | None) -> list[tuple[str, str]]:
    """Run-summary lines ("fallbacks", "jit") for RunMetrics.summary()["kernels"]; none when there is nothing to
    report (torch only, nothing fell back)."""
    if not kernels:
        return []
    lines = []
    calls = kernels.get("fallbacks") or {}
    if calls:
        lines.append(("per call", "; ".join(f"{kind}: {n} calls to torch ({reason})" for kind, reasons in calls.items()
                                            for reason, n in reasons.items())))
    jit = kernels.get("jit")
    if jit:
        text = (f"{jit['compiled']} compiled, {jit['cache_hits']} from cache, {jit['seconds']:.1f} s "
                f"({jit['cache_dir']}){'' if jit.get('pdl', True) else '; PDL off'}")
        manifest = jit.get("manifest")
        if manifest:
            skipped = manifest["stale"] + manifest["failed"]
            text += (f"; manifest: {manifest['listed']} built in parallel in {manifest['seconds']:.1f} s"
                     + (f", {skipped} lines skipped" if skipped else ""))
        lines.append(("jit", text))
    return lines
