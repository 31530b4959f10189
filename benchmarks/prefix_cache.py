"""Prefix caching on vs off, in one run, on the same engine settings (issue 26's workloads, CPU-sized by default):

  (a) shared: N requests sharing a system prompt of S tokens plus 100..500 unique tokens each (the first request
      alone, then the rest at once);
  (b) chat: a T-turn conversation, each turn resending the whole history (previous prompt + answer) plus a new
      user message;
  (c) unshared: random prompts with no shared prefix (the cost of caching when it never hits).

For each: prefill tokens computed, hit rate, TTFT p50/p99, wall time and output tok/s with the cache on and off,
the memory the cache held (window checkpoints), and whether the outputs were identical (greedy). The JSON has a
top-level `targets` list (issue 26's targets; the TTFT one is for the H200, measured here on the CPU).

    python benchmarks/prefix_cache.py --json benchmarks/results/prefix_cache_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:tiny")
    ap.add_argument("--shared-tokens", type=int, default=2048, help="(a) system prompt length (the issue: 4096)")
    ap.add_argument("--shared-requests", type=int, default=16, help="(a) requests (the issue: 64)")
    ap.add_argument("--turns", type=int, default=10, help="(b) conversation turns")
    ap.add_argument("--turn-tokens", type=int, default=120, help="(b) new user tokens per turn")
    ap.add_argument("--unshared-requests", type=int, default=32, help="(c) requests of 100..500 random tokens")
    ap.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--memory-budget", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def engine(args, on: bool):
    from deepinfer.api import load_settings, overrides_for
    from deepinfer.frontend import LLMEngine

    settings = load_settings(overrides_for(
        args.model, [f"cache.prefix_caching={str(on).lower()}"], hardware="cpu", process="inproc",
        zero_overhead_scheduling=True, max_num_seqs=32, max_num_batched_tokens=args.max_num_batched_tokens,
        memory_budget=args.memory_budget, runtime={"num_threads": args.threads or None}))
    return LLMEngine.for_settings(settings)


def greedy(n: int):
    from deepinfer.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(eng, batches) -> dict:
    """batches: a list of callables(previous outputs) -> (prompts, params), served one generate() each."""
    totals = {"prefill_tokens": 0, "hit_tokens": 0, "query_tokens": 0, "generated_tokens": 0}
    ttft, outputs, prefix = [], [], None
    t0 = time.perf_counter()
    for make in batches:
        prompts, params = make(outputs)
        outs = eng.generate(prompts, params, use_tqdm=False)
        m = eng.last_metrics
        outputs += outs
        totals["prefill_tokens"] += m["prefill_tokens"]
        totals["generated_tokens"] += m["generated_tokens"]
        ttft += [o.metrics.time_to_first_token for o in outs]
        if m["prefix_cache"]:
            prefix = m["prefix_cache"]
            totals["hit_tokens"] += prefix["hit_tokens"]
            totals["query_tokens"] += prefix["query_tokens"]
    wall = time.perf_counter() - t0
    ttft.sort()
    return {**totals, "wall_s": wall, "output_tokens_per_s": totals["generated_tokens"] / wall,
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "hit_rate": totals["hit_tokens"] / totals["query_tokens"] if totals["query_tokens"] else 0.0,
            "checkpoint_bytes": prefix["checkpoint_bytes"] if prefix else 0,
            "cached_blocks": prefix["cached_blocks"] if prefix else 0,
            "tokens": [o.token_ids for o in outputs]}


def workloads(args, vocab: int) -> dict:
    rng = random.Random(args.seed)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system = words(args.shared_tokens)
    shared = [system + words(rng.randint(100, 500)) for _ in range(args.shared_requests)]
    user = [words(args.turn_tokens) for _ in range(args.turns)]
    unshared = [words(rng.randint(100, 500)) for _ in range(args.unshared_requests)]
    n = args.max_tokens

    def turn(t):
        def make(prev):
            history = [] if t == 0 else prev[-1].prompt_token_ids + prev[-1].token_ids
            return [history + user[t]], [greedy(n)]
        return make

    return {
        "shared": [lambda prev: (shared[:1], [greedy(n)]), lambda prev: (shared[1:], [greedy(n)] * (len(shared) - 1))],
        "chat": [turn(t) for t in range(args.turns)],
        "unshared": [lambda prev: (unshared, [greedy(n)] * len(unshared))],
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    command = "python benchmarks/prefix_cache.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = {"command": command, "workloads": {}}
    for on in (False, True):
        with engine(args, on) as eng:
            eng.generate([[5, 6, 7]], greedy(2), use_tqdm=False)  # warm-up
            results.setdefault("cache", {})["on" if on else "off"] = eng.info.cache_description
            for name, batches in workloads(args, eng.info.vocab_size).items():
                results["workloads"].setdefault(name, {})["on" if on else "off"] = run(eng, batches)
    for name, w in results["workloads"].items():
        off, on = w["off"], w["on"]
        w["identical_outputs"] = off.pop("tokens") == on.pop("tokens")
        w["prefill_ratio"] = on["prefill_tokens"] / off["prefill_tokens"]
        w["ttft_p50_ratio"] = on["ttft_p50_s"] / off["ttft_p50_s"]
        w["throughput_ratio"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
        print(f"{name:9s} prefill tokens {off['prefill_tokens']:7d} -> {on['prefill_tokens']:7d} "
              f"({w['prefill_ratio']:.3f}x), hit rate {on['hit_rate']:.1%}, TTFT p50 {off['ttft_p50_s'] * 1e3:.0f} -> "
              f"{on['ttft_p50_s'] * 1e3:.0f} ms, wall {off['wall_s']:.1f} -> {on['wall_s']:.1f} s, "
              f"tok/s x{w['throughput_ratio']:.3f}, identical outputs: {w['identical_outputs']}")
    W = results["workloads"]
    results["targets"] = [
        {"name": "(a) shared system prompt: TTFT p50 with the cache / without (target on the H200; measured on the CPU)",
         "measured": W["shared"]["ttft_p50_ratio"], "target": 0.2, "unit": "x", "met": W["shared"]["ttft_p50_ratio"] <= 0.2},
        {"name": "(b) 10-turn chat: prefill tokens computed with the cache / without", "measured": W["chat"]["prefill_ratio"],
         "target": 0.25, "unit": "x", "met": W["chat"]["prefill_ratio"] <= 0.25},
        {"name": "(c) no shared prefix: output tok/s with the cache / without", "measured": W["unshared"]["throughput_ratio"],
         "target": 0.98, "unit": "x", "met": W["unshared"]["throughput_ratio"] >= 0.98},
        {"name": "exactness: workloads whose outputs differ with the cache on", "measured":
         sum(not w["identical_outputs"] for w in W.values()), "target": 0, "unit": "workloads",
         "met": all(w["identical_outputs"] for w in W.values())},
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
