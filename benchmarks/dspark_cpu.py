#!/usr/bin/env python3
"""DSpark on the CPU (embedded model, random draft layers: ~0% acceptance): what drafting costs with every draft
verified, and how much of it confidence-scheduled verification (decoding.varlen) gives back. Also the copied-draft
case (the target's own continuation: ~100% acceptance) for the speed-up side.

    python benchmarks/dspark_cpu.py --out benchmarks/results/dspark_cpu.json

32 greedy requests (prompts 16..64 tokens, 48 new tokens each), in-process engine, async scheduling, one thread;
decode tokens/s = generated tokens over the run's decode device time (RunMetrics), median of --runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def run(model_dir, prompts, params, drafts, varlen, override=None):
    from deepinfer.api import load_settings, overrides_for
    from deepinfer.frontend import LLMEngine

    decoding = ["decoding=dspark", f"decoding.num_draft_tokens={drafts}", f"decoding.varlen={str(varlen).lower()}"]
    settings = load_settings(overrides_for(model_dir, decoding if drafts else ["decoding=plain"], hardware="cpu",
                                           process="inproc", memory_budget=1 << 27, max_num_batched_tokens=2048,
                                           zero_overhead_scheduling=True, runtime={"num_threads": 1}))
    with LLMEngine.for_settings(settings) as eng:
        if override is not None:
            eng.client.core.runner.draft_override = override
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        m = eng.last_metrics
    return [o.token_ids for o in outs], wall, m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/dspark_cpu.json")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    from deepinfer import embedded
    from deepinfer.sampling import SamplingParams

    model_dir = str(embedded.materialize("tiny-random"))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 64))] for _ in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True) for _ in prompts]
    reference, _, _ = run(model_dir, prompts, params, 0, False)
    want = {tuple(p): out for p, out in zip(prompts, reference)}

    def copy(ids, num_prompt, guesses):
        out = want[tuple(ids[:num_prompt])]
        done = len(ids) - num_prompt
        return (out[done:] + [0] * len(guesses))[: len(guesses)]

    rows, failures = [], []
    for name, drafts, varlen, override in (("plain", 0, False, None), ("dspark random", 5, False, None),
                                           ("dspark random varlen", 5, True, None),
                                           ("dspark copy", 5, False, copy), ("dspark copy varlen", 5, True, copy)):
        walls, rates, spec = [], [], None
        for _ in range(a.runs):
            tokens, wall, m = run(model_dir, prompts, params, drafts, varlen, override)
            if tokens != reference:
                failures.append(f"{name}: output differs from plain decoding")
            walls.append(wall)
            rates.append(m["generated_tokens"] / wall)
            spec = m.get("speculative")
        row = {"variant": name, "wall_s": statistics.median(walls), "tok_s": statistics.median(rates),
               "acceptance": spec["acceptance_rate"] if spec else None,
               "drafts_verified": spec["draft_tokens"] if spec else 0,
               "mean_accepted_length": spec["mean_accepted_length"] if spec else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["tok_s"]
    for r in rows:
        r["vs_plain"] = r["tok_s"] / base
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    # issue 12 names no target (speed-up and overhead reported); issue 21's DSpark targets are dspark_gpu.py's
    out = {"cmd": " ".join(sys.argv), "targets": [], "rows": rows, "failures": failures}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
