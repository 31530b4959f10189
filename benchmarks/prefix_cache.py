#!/usr/bin/env python3
"""Prefix caching on vs off in one run (issue 26): two engines on the same model object, one with
cache.prefix_caching on and one with it off, fed the same requests, workload by workload:

  (a) shared: N requests sharing a system prompt of S tokens plus 100..500 unique tokens each (the first request
      alone, then the other N - 1 at once; TTFT over those N - 1);
  (b) chat: a T-turn conversation, each turn resending the whole history (previous prompt + its answer) plus a new
      user message of U tokens;
  (c) unshared: R rounds of M random prompts of 100..500 tokens, nothing shared (what the cache costs when it never
      hits); the engines alternate which runs a round first, and throughput is the median over rounds.

Per workload and engine: prefill tokens computed, hit rate (prompt tokens found cached at admission / looked up),
TTFT p50/p99 (host clock, submission to first token, RequestOutput.metrics), total tok/s (prompt + generated
tokens over the workload's wall time) and output tok/s, the memory the cache held at its end (window checkpoints +
cached blocks), and how many requests' outputs differ token for token between the engines (greedy). The JSON has a
top-level `targets` list: (a) TTFT p50 on/off <= 0.2 (the issue's target is on the H200), (b) prefill tokens
on/off <= 0.25, (c) total tok/s on/off >= 0.98, 0 requests with different outputs.

Models (--model): `tiny` (the embedded tiny checkpoint, float32 on the CPU: the CI-sized run), `flash6` (alias
`flash`: synthetic V4.1-Flash width, 6 layers) and `flash40` (the released 40-layer pattern, layers of one kind
sharing weights), bf16 with TileLang kernels preferred, CUDA graphs on, as benchmarks/decode_gpu.py builds them.
On CUDA the model is built in the batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1's op set and sampler, as
tests/gpu/test_engine_batch_invariance.py builds it): a hit changes how a prompt is cut into steps and which rows
share a step, which only that mode makes bitwise-neutral on the GPU (the CPU ops are row-invariant already).

Exit status 1 when the run did not measure what it claims: a request ended with an error, the cache-on engine
never hit in (a) or (b), a CUDA run whose heavy ops fell back to torch or whose decode steps never replayed a CUDA
graph. Every figure is written first.

    python benchmarks/prefix_cache.py --json benchmarks/results/prefix_cache_cpu.json     # CPU, ~7 min on 2 busy cores
    # on the H200 (device tool, carry [".devpack"]), from the repo root:
    source benchmarks/gpu_env.sh
    python3 benchmarks/prefix_cache.py --model flash6 --json $OUT/prefix_cache_flash6_h200.json
    python3 benchmarks/prefix_cache.py --model flash40 --shared-requests 32 --json $OUT/prefix_cache_flash40_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_gpu import STRICT_KINDS, _fallback_delta, build, portable_json  # noqa: E402

# sizes per kind of run: the workloads on the GPU (fewer output tokens, so it fits in minutes), smaller on
# the CPU (a 2-core VM); any can be set by its flag
GPU_DEFAULTS = dict(shared_tokens=4096, shared_requests=64, turns=10, turn_tokens=200, unshared_requests=32,
                    rounds=5, max_tokens=16, max_num_batched_tokens=8192, max_num_seqs=64, memory_budget=8 << 30)
CPU_DEFAULTS = dict(shared_tokens=2048, shared_requests=16, turns=10, turn_tokens=120, unshared_requests=32,
                    rounds=3, max_tokens=32, max_num_batched_tokens=512, max_num_seqs=32, memory_budget=64 << 20)
WORKLOADS = ("shared", "chat", "unshared")
PROMPT_IDS = (3, 500)  # prompt ids inside the package tokenizer's vocabulary (Engram's token map), as decode_gpu


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "flash6", "flash", "flash40"), default="tiny")
    ap.add_argument("--device", default=None, help="default: cuda for the flash models, else cpu")
    ap.add_argument("--shared-tokens", type=int, help="(a) system prompt length (the issue: 4096)")
    ap.add_argument("--shared-requests", type=int, help="(a) requests (the issue: 64)")
    ap.add_argument("--turns", type=int, help="(b) conversation turns (the issue: 10)")
    ap.add_argument("--turn-tokens", type=int, help="(b) new user tokens per turn")
    ap.add_argument("--unshared-requests", type=int, help="(c) requests of 100..500 random tokens per round")
    ap.add_argument("--rounds", type=int, help="(c) rounds (the engines take turns going first)")
    ap.add_argument("--max-tokens", type=int, help="generated tokens per request (greedy, EOS ignored)")
    ap.add_argument("--max-num-batched-tokens", type=int)
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--memory-budget", type=int, help="cache bytes per engine (checkpoints: 10%% of it)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="CUDA graphs off")
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                    help="which of (a) shared, (b) chat, (c) unshared to run (targets: those run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.model == "flash":
        a.model = "flash6"
    a.device = a.device or ("cuda" if a.model.startswith("flash") else "cpu")
    for k, v in (GPU_DEFAULTS if a.device.startswith("cuda") else CPU_DEFAULTS).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


# ---- engines ----------------------------------------------------------------------------------------------------
def make_engines(args):
    """(the model, {False: cache-off engine, True: cache-on engine}): both on the one model object, the same options
    but prefix_caching. CUDA: TileLang kernels preferred, the batch-invariant op set and sampler."""
    from deepinfer.config.schema import Settings
    from deepinfer.engine import EngineOptions
    from deepinfer.engine.backend import backend_from_model
    from deepinfer.frontend import LLMEngine

    cuda = args.device.startswith("cuda")
    prefs = {"default": ["tilelang-sm90", "torch"]} if cuda else ["torch"]
    name = "tiny" if args.model == "tiny" else ("flash40" if args.model == "flash40" else "flash")
    model = build(name, args.device, prefs, batch_invariant=cuda)
    backend = backend_from_model(model, batch_invariant=cuda)
    longest = max(args.shared_tokens + 500, args.turns * (args.turn_tokens + args.max_tokens), 500)
    max_len = math.ceil((longest + args.max_tokens + 1) / args.block_size + 1) * args.block_size
    engines = {}
    for on in (False, True):
        opts = EngineOptions.for_settings(
            Settings(), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_len, memory_budget=args.memory_budget, block_size=args.block_size, process="inproc",
            zero_overhead_scheduling=not args.sync, enforce_eager=args.eager or not cuda, seed=0,
            num_threads=None if cuda else args.threads, prefix_caching=on)
        engines[on] = LLMEngine(lambda: backend, opts)
    return model, engines


def greedy(n: int):
    from deepinfer.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def cache_bytes(eng) -> dict:
    """What the engine's prefix cache holds now: window checkpoints and blocks that hold a named prefix."""
    cache = eng.client.core.cache
    stats = cache.prefix_stats()
    if stats is None:
        return {"checkpoint_bytes": 0, "cached_block_bytes": 0, "checkpoints": 0, "cached_blocks": 0}
    return {"checkpoint_bytes": stats["checkpoint_bytes"], "cached_block_bytes": stats["cached_blocks"] * cache.block_bytes,
            "checkpoints": stats["checkpoints"], "cached_blocks": stats["cached_blocks"]}


def run(eng, batches, max_tokens: int) -> dict:
    """batches: (make, timed) pairs; make(previous outputs) -> prompts, served by one generate() each (greedy,
    `max_tokens` each); TTFT is taken over the outputs of the `timed` batches."""
    totals = {"prefill_tokens": 0, "hit_tokens": 0, "query_tokens": 0, "generated_tokens": 0, "prompt_tokens": 0,
              "graph_steps": 0, "steps": 0}
    ttft, outputs, errors = [], [], []
    t0 = time.perf_counter()
    for make, timed in batches:
        prompts = make(outputs)
        outs = eng.generate(prompts, greedy(max_tokens), use_tqdm=False)
        m = eng.last_metrics
        outputs += outs
        errors += [o.error for o in outs if o.error]
        for k in ("prefill_tokens", "generated_tokens", "graph_steps", "steps"):
            totals[k] += m[k]
        totals["prompt_tokens"] += sum(len(p) for p in prompts)
        if timed:
            ttft += [o.metrics.time_to_first_token for o in outs]
        if m["prefix_cache"]:
            totals["hit_tokens"] += m["prefix_cache"]["hit_tokens"]
            totals["query_tokens"] += m["prefix_cache"]["query_tokens"]
    wall = time.perf_counter() - t0
    ttft.sort()
    return {**totals, "wall_s": wall, "errors": errors[:3],
            "total_tokens_per_s": (totals["prompt_tokens"] + totals["generated_tokens"]) / wall,
            "output_tokens_per_s": totals["generated_tokens"] / wall,
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "hit_rate": totals["hit_tokens"] / totals["query_tokens"] if totals["query_tokens"] else 0.0,
            **cache_bytes(eng), "tokens": [o.token_ids for o in outputs]}


# ---- workloads --------------------------------------------------------------------------------------------------
def workloads(args, seed: int) -> dict:
    """name -> list of rounds; a round: (make, timed) batches. Prompts from `seed` (warm-up runs use another)."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(*PROMPT_IDS) for _ in range(n)]  # noqa: E731
    system = words(args.shared_tokens)
    shared = [system + words(rng.randint(100, 500)) for _ in range(args.shared_requests)]
    user = [words(args.turn_tokens) for _ in range(args.turns)]
    unshared = [[words(rng.randint(100, 500)) for _ in range(args.unshared_requests)] for _ in range(args.rounds)]

    def turn(t):
        def make(prev):
            return [([] if t == 0 else prev[-1].prompt_token_ids + prev[-1].token_ids) + user[t]]
        return make, True

    return {
        "shared": [[(lambda prev: shared[:1], False), (lambda prev: shared[1:], True)]],
        "chat": [[turn(t) for t in range(args.turns)]],
        "unshared": [[(lambda prev, r=r: unshared[r], True)] for r in range(args.rounds)],
    }


def warm_up(args, engines) -> None:
    """JIT compiles, first kernel launches and small CUDA graphs on both engines, with prompts of other tokens than
    the timed ones (nothing the timed runs could hit): a short version of (a) and one chat turn."""
    w = argparse.Namespace(**{**vars(args), "shared_requests": 4, "turns": 2, "unshared_requests": 2, "rounds": 1})
    for eng in engines.values():
        for rounds in workloads(w, seed=args.seed + 1000).values():
            run(eng, rounds[0], args.max_tokens)


def compare(off: dict, on: dict) -> dict:
    diffs = sum(a != b for a, b in zip(off.pop("tokens"), on.pop("tokens")))
    return {"off": off, "on": on, "different_outputs": diffs,
            "prefill_ratio": on["prefill_tokens"] / max(off["prefill_tokens"], 1),
            "ttft_p50_ratio": on["ttft_p50_s"] / off["ttft_p50_s"],
            "throughput_ratio": on["total_tokens_per_s"] / off["total_tokens_per_s"]}


def median_rounds(rounds: list[dict]) -> dict:
    """(c): one row from R rounds: sums of counts, medians of times and rates (the ratio is that of the medians)."""
    out = {}
    for side in ("off", "on"):
        rows = [r[side] for r in rounds]
        row = {k: (statistics.median(r[k] for r in rows) if k.endswith(("_s", "_per_s")) else sum(r[k] for r in rows))
               for k in rows[0] if isinstance(rows[0][k], (int, float))}
        row["hit_rate"] = row["hit_tokens"] / row["query_tokens"] if row["query_tokens"] else 0.0
        row.update({k: rows[-1][k] for k in ("checkpoint_bytes", "cached_block_bytes", "checkpoints", "cached_blocks")})
        row["errors"] = [e for r in rows for e in r["errors"]][:3]
        out[side] = row
    out["different_outputs"] = sum(r["different_outputs"] for r in rounds)
    out["prefill_ratio"] = out["on"]["prefill_tokens"] / max(out["off"]["prefill_tokens"], 1)
    out["ttft_p50_ratio"] = out["on"]["ttft_p50_s"] / out["off"]["ttft_p50_s"]
    out["throughput_ratio"] = out["on"]["total_tokens_per_s"] / out["off"]["total_tokens_per_s"]
    out["throughput_ratio_per_round"] = [r["throughput_ratio"] for r in rounds]
    # engine steps, on / off: what the cache adds whatever the machine's load (a prompt's tail after its checkpoint
    # boundary may take a step of its own)
    out["steps_ratio"] = out["on"]["steps"] / out["off"]["steps"]
    return out


def targets(W: dict, cuda: bool) -> list[dict]:
    """One entry per target of the workloads run, and exactness over them."""
    where = "" if cuda else " (the target is for the H200; measured on the CPU)"
    out = []
    if "shared" in W:
        r = W["shared"]["ttft_p50_ratio"]
        out.append({"name": f"(a) shared system prompt: TTFT p50 with the cache / without{where}",
                    "measured": round(r, 4), "target": 0.2, "unit": "x", "met": r <= 0.2})
    if "chat" in W:
        r = W["chat"]["prefill_ratio"]
        out.append({"name": "(b) chat resending its history: prefill tokens computed with the cache / without",
                    "measured": round(r, 4), "target": 0.25, "unit": "x", "met": r <= 0.25})
    if "unshared" in W:
        r = W["unshared"]["throughput_ratio"]
        out.append({"name": "(c) no shared prefix: total tok/s with the cache / without (median of rounds)",
                    "measured": round(r, 4), "target": 0.98, "unit": "x", "met": r >= 0.98})
    diffs = sum(w["different_outputs"] for w in W.values())
    out.append({"name": "exactness: requests whose output tokens differ with the cache on (workloads run)",
                "measured": diffs, "target": 0, "unit": "requests", "met": diffs == 0})
    return out


def failures(W: dict, cuda: bool, fallbacks: dict) -> list[str]:
    """Why this run did not measure what it claims (empty: it did)."""
    bad = [f"{name} {side}: requests ended with errors: {w[side]['errors']}"
           for name, w in W.items() for side in ("off", "on") if w[side]["errors"]]
    bad += [f"{name}: the cache-on engine never hit"
            for name in ("shared", "chat") if name in W and not W[name]["on"]["hit_tokens"]]
    bad += [f"{name}: the cache-off engine reported hits" for name, w in W.items() if w["off"]["hit_tokens"]]
    if cuda:
        strict = {k: v for k, v in fallbacks.items() if k in STRICT_KINDS}
        if strict:
            bad.append(f"per-call fallbacks to torch in a TileLang run: {strict}")
        if not any(w[side]["graph_steps"] for w in W.values() for side in ("off", "on")):
            bad.append("CUDA graphs requested, but no decode step replayed one")
    return bad


def main(argv=None) -> int:
    from deepinfer.kernels.registry import kernel_stats

    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    t_start = time.time()
    model, engines = make_engines(args)
    meta = {"model": args.model, "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "batch_invariant": cuda, "graphs": cuda and not args.eager,
            "scheduling": "sync" if args.sync else "async", "ops": model.ops.summary(),
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "command": "python benchmarks/prefix_cache.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "cache": {"off": engines[False].info.cache_description, "on": engines[True].info.cache_description},
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    print(f"model {args.model} on {args.device}: {meta['cache']['on']}", flush=True)
    results = {"meta": meta, "targets": [], "workloads": {}, "failures": []}

    def flush():
        meta["wall_s"] = time.time() - t_start
        if args.json:
            os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
            with open(args.json, "w") as f:
                f.write(portable_json(results))

    try:
        warm_up(args, engines)
        print(f"warm-up done at {time.time() - t_start:.0f} s", flush=True)
        before = kernel_stats()["fallbacks"]
        W = results["workloads"]
        for name, rounds in workloads(args, args.seed).items():
            if name not in args.workloads:
                continue
            done = []
            for r, batches in enumerate(rounds):
                # (a) cache-on first (it pays any first-use cost), (b) off first, (c) alternating
                order = (True, False) if (name == "shared" or (name == "unshared" and r % 2)) else (False, True)
                got = {on: run(engines[on], batches, args.max_tokens) for on in order}
                done.append(compare(got[False], got[True]))
            W[name] = done[0] if len(done) == 1 else median_rounds(done)
            w = W[name]
            print(f"{name:9s} prefill tokens {w['off']['prefill_tokens']:7d} -> {w['on']['prefill_tokens']:7d} "
                  f"({w['prefill_ratio']:.3f}x), hit rate {w['on']['hit_rate']:.1%}, TTFT p50 "
                  f"{w['off']['ttft_p50_s'] * 1e3:.0f} -> {w['on']['ttft_p50_s'] * 1e3:.0f} ms "
                  f"({w['ttft_p50_ratio']:.3f}x), total tok/s {w['off']['total_tokens_per_s']:.0f} -> "
                  f"{w['on']['total_tokens_per_s']:.0f} ({w['throughput_ratio']:.3f}x), cache holds "
                  f"{(w['on']['checkpoint_bytes'] + w['on']['cached_block_bytes']) / 2**20:.1f} MiB, "
                  f"different outputs: {w['different_outputs']}  [{time.time() - t_start:.0f} s]", flush=True)
            if len(done) > 1:
                print(f"{'':9s} tok/s ratio per round: {', '.join(f'{x:.3f}' for x in w['throughput_ratio_per_round'])}"
                      f"; engine steps {w['off']['steps']} -> {w['on']['steps']}", flush=True)
            flush()
        fallbacks = _fallback_delta(before, kernel_stats()["fallbacks"])
        meta["fallbacks"] = fallbacks
        results["targets"] = targets(W, cuda)
        results["failures"] = failures(W, cuda, fallbacks)
    finally:
        for eng in engines.values():
            eng.close()
        flush()
    for t in results["targets"]:
        print(f"target {'met' if t['met'] else 'NOT met'}: {t['name']}: {t['measured']} (target {t['target']})")
    for f in results["failures"]:
        print("FAILURE:", f, file=sys.stderr)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
