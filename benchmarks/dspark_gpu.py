#!/usr/bin/env python3
"""DSpark speculative decoding through the real engine: decode tokens/s per user with drafts always accepted
(copying the target), with drafts (almost) never accepted (the random draft layers), and without drafts, at
batch 1 and 64, on the V4.1-Flash-width synthetic model of decode_gpu.py with V4.1-Flash's three draft layers.

    source benchmarks/gpu_env.sh
    python3 benchmarks/dspark_gpu.py --out $OUT/dspark_gpu.json

Variants per batch (each its own engine over the same model, the same seed: identical filled contexts):
  plain   decoding=plain: one token per step.
  random  decoding=dspark, 5 drafts: the synthetic draft layers' own guesses (random weights: ~0% accepted), so
          the step pays drafting + verifying 6 tokens per request and gains ~nothing: the overhead.
  copy    decoding=dspark, 5 drafts replaced (runner.draft_override, after the drafter ran, so its cost is in the
          step) by the target's own continuation recorded by `random` (whose tokens are the target's by
          losslessness): every draft the target re-derives the same way is accepted: the speed-up.
tokens/s per user = (1 + mean accepted drafts per verifying request) / median step time; a step = forward +
verification + drafting. Context: decode_gpu.py's filled context (random valid cache codes, the draft layers'
rings too), 4096 tokens. CUDA graphs on (verification steps replay graphs keyed by batch, blocks and 6 tokens).

Exit status non-zero when a variant did not run as asked (a timed step that did not replay a graph, an error, a
TileLang kernel falling back to torch, copy's acceptance below 90% or random's above 10%); rows are written first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_gpu import STRICT_KINDS, StepTap, _fallback_delta, make_engine, portable_json  # noqa: E402


def run_variant(model, name: str, batch: int, context: int, steps: int, warmup: int, reference=None):
    from deepinfer import SamplingParams
    from deepinfer.kernels.registry import kernel_stats

    drafts = 0 if name == "plain" else 5
    per_step = 1 + drafts
    max_tokens = per_step * (warmup + steps) + 1
    engine, tap, _ = make_engine(model, fill=True, max_seqs=batch, context=context, max_tokens=max_tokens,
                                 graphs=True, interval=8, batched_tokens=max(batch * context, 8192),
                                 num_draft=drafts, seed=1)
    g = torch.Generator().manual_seed(batch * 7919 + context)
    prompts = torch.randint(3, 500, (batch, context), generator=g).tolist()
    if name == "copy":
        want = {tuple(p): out for p, out in zip(prompts, reference)}

        def copy(ids, num_prompt, guesses):
            out = want[tuple(ids[:num_prompt])]
            done = len(ids) - num_prompt
            return (out[done:] + [0] * len(guesses))[: len(guesses)]

        engine.client.core.runner.draft_override = copy
    before = kernel_stats()["fallbacks"]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        outs = engine.generate(prompts, sp, use_tqdm=False)
    finally:
        engine.close()
    fallbacks = {k: v for k, v in _fallback_delta(before, kernel_stats()["fallbacks"]).items() if k in STRICT_KINDS}
    all_steps = tap.take()
    decode = [s for s in all_steps if s.num_prefill_tokens == 0 and s.num_rows == batch]
    timed = decode[warmup: warmup + steps]
    ms = statistics.median((s.device_end - s.device_start) * 1e3 for s in timed) if timed else float("nan")
    lengths = [m for s in timed for m in s.accepted_lengths]
    gained = 1 + (sum(lengths) / len(lengths) if lengths else 0.0)
    drafted = sum(s.num_draft_tokens for s in all_steps)
    accepted = sum(s.num_accepted_tokens for s in all_steps)
    row = dict(variant=name, batch=batch, context=context, step_ms=ms, tokens_per_step_per_user=gained,
               tok_s_per_user=gained * 1e3 / ms, tok_s_total=batch * gained * 1e3 / ms,
               acceptance=accepted / drafted if drafted else None, drafted=drafted, accepted=accepted,
               timed_steps=len(timed), graph_steps=sum(s.graph for s in timed),
               draft_graph_steps=sum(s.draft_graph for s in timed), fallbacks=fallbacks,
               errors=[o.error for o in outs if o.finish_reason == "error"])
    return row, [o.token_ids for o in outs]


def check(row) -> list[str]:
    bad = []
    tag = f"{row['variant']} B={row['batch']}"
    if row["timed_steps"] == 0 or row["graph_steps"] != row["timed_steps"]:
        bad.append(f"{tag}: {row['graph_steps']} of {row['timed_steps']} timed steps replayed a CUDA graph")
    if row["variant"] != "plain" and row["draft_graph_steps"] != row["timed_steps"]:
        bad.append(f"{tag}: drafting replayed a CUDA graph in {row['draft_graph_steps']} of {row['timed_steps']} "
                   f"timed steps")
    if row["errors"]:
        bad.append(f"{tag}: errors {row['errors'][:2]}")
    if row["fallbacks"]:
        bad.append(f"{tag}: TileLang calls fell back to torch {row['fallbacks']}")
    if row["variant"] == "copy" and (row["acceptance"] or 0) < 0.9:
        bad.append(f"{tag}: acceptance {row['acceptance']:.1%} < 90% with copied drafts")
    if row["variant"] == "random" and (row["acceptance"] or 0) > 0.1:
        bad.append(f"{tag}: acceptance {row['acceptance']:.1%} > 10% with random draft layers")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/dspark_gpu.json")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
    from deepinfer.models import synthetic

    t0 = time.time()
    model = synthetic.build_model(synthetic.config(synthetic.DSPARK_FLASH), "cuda", torch.bfloat16,
                                  backends={"default": ["tilelang-sm90", "torch"]})
    print(f"model built in {time.time() - t0:.0f} s (drafter: {model.drafter.num_layers} layers)", flush=True)
    rows, failures = [], []
    for batch in a.batches:
        for name in ("plain", "random", "copy"):
            ref = rows[-1]["_outputs"] if name == "copy" else None
            row, outputs = run_variant(model, name, batch, a.context, a.steps, a.warmup, ref)
            row["_outputs"] = outputs
            rows.append(row)
            failures += check(row)
            print(f"B={batch:<3} {name:<6} step {row['step_ms']:.2f} ms, {row['tokens_per_step_per_user']:.2f} "
                  f"tok/step/user, {row['tok_s_per_user']:.1f} tok/s/user, {row['tok_s_total']:.0f} tok/s, "
                  f"acceptance {row['acceptance']}", flush=True)
        plain = next(r for r in rows if r["batch"] == batch and r["variant"] == "plain")
        for r in rows:
            if r["batch"] == batch and r["variant"] != "plain":
                r["speedup_vs_plain"] = r["tok_s_per_user"] / plain["tok_s_per_user"]
    out = [{k: v for k, v in r.items() if k != "_outputs"} for r in rows]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cmd=" ".join(sys.argv),
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), wall_s=time.time() - t0,
                note="decode context filled with random valid cache codes (decode_gpu.py FillBackend)")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    Path(a.out).write_text(portable_json({"meta": meta, "rows": out, "failures": failures}))
    for r in out:
        print(json.dumps({k: r[k] for k in ("variant", "batch", "step_ms", "tok_s_per_user", "acceptance")}
                         | {"speedup": r.get("speedup_vs_plain")}))
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
