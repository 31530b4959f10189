"""Does a sequence's output depend on what it is batched with, on the GPU? With the batch-invariant mode off and on
(`OpSet.build(batch_invariant=...)`, what DEEPINFER_BATCH_INVARIANT selects), on a kernel-sized V4.1 model in bf16
(64 heads x 512, FP4/FP8 experts, every TileLang kernel engaged), TileLang preferred:

  - one target sequence's logits, every prompt row: alone, inside batches of 3, 8 and 16 sequences of other
    lengths, and with its prompt chunked (two steps) beside other sequences;
  - per variant: rows that differ from the alone run and the max |diff|; greedy (argmax) flips;
  - cost: a decode step of 64 sequences at a 512-token context, eager, CUDA events, median of 10, mode off vs on.

    python3 benchmarks/batch_invariance_gpu.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

SMALL = dict(hidden_size=1024, vocab_size=1024, n_routed_experts=64, moe_intermediate_size=256, q_lora_rank=512,
             o_lora_rank=256, index_topk=64, candidate_topk_blocks=16, engram_vocab_size=1000)


def logits_of_target(model, target, others, cut=None):
    from deepinfer.models import ForwardBatch

    if cut is None:
        states = [model.new_state() for _ in range(len(others) + 1)]
        out = model.forward(ForwardBatch([*others, target], states, all_logits=True))
        return out[-len(target):]
    st = model.new_state()
    first = model.forward(ForwardBatch([target[:cut]], [st], all_logits=True))
    states = [model.new_state() for _ in others]
    rest = model.forward(ForwardBatch([*others, target[cut:]], [*states, st], all_logits=True))
    return torch.cat([first, rest[-(len(target) - cut):]])


def compare(model, rng, vocab):
    target = [rng.randrange(3, vocab) for _ in range(37)]
    alone = logits_of_target(model, target, [])
    rows = {}
    for n in (3, 8, 16):
        others = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 90))] for _ in range(n - 1)]
        rows[f"batch {n}"] = logits_of_target(model, target, others)
    others = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 90))] for _ in range(5)]
    rows["chunked 20+17 beside 5"] = logits_of_target(model, target, others, cut=20)
    out = {}
    for name, got in rows.items():
        diff = (got.float() - alone.float()).abs()
        out[name] = dict(rows_differing=int((diff.amax(-1) > 0).sum()), rows=len(target),
                         max_abs_diff=float(diff.max()), argmax_flips=int((got.argmax(-1) != alone.argmax(-1)).sum()))
    return out


def decode_ms(model, vocab, batch=64, context=512, reps=10):
    from deepinfer.models import ForwardBatch

    rng = random.Random(1)
    states = [model.new_state() for _ in range(batch)]
    model.forward(ForwardBatch([[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)], states))
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        model.forward(ForwardBatch([[rng.randrange(3, vocab)] for _ in range(batch)], states))
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


COST_LIMIT = 15.0  # issue 22: the mode costs <= 15% of a decode step at B=64


def targets(result: dict) -> list[dict]:
    """Issue 22's targets as this model-level run measures them (its engine cases are tests/gpu's, its prefill cost
    batch_invariance_cost_gpu.py's): 0 rows differing with the mode on, and the B=64 decode step's cost."""
    on, off = result["invariant"], result["default"]
    rows = sum(r["rows_differing"] for r in on.values() if isinstance(r, dict))
    cost = (on["decode_step_ms_b64_ctx512"] / off["decode_step_ms_b64_ctx512"] - 1) * 100
    return [dict(name="batch-invariant mode: logit rows differing from the sequence alone (batched, chunked cases)",
                 measured=rows, target=0, unit="rows", met=rows == 0),
            dict(name="batch-invariant mode's cost, eager decode step B=64 ctx=512 (kernel-sized model)",
                 measured=round(cost, 1), target=COST_LIMIT, unit="% over off", met=cost <= COST_LIMIT)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from deepinfer.kernels.registry import OpSet, fallback_counts
    from deepinfer.models import synthetic

    prefs = {"default": ["tilelang-sm90", "torch"]}
    cfg = synthetic.config(SMALL)
    model = synthetic.build_model(cfg, "cuda", torch.bfloat16, backends=prefs, seed=3)
    result = {}
    for mode in (False, True):
        model.use_ops(OpSet.build("cuda", prefs, batch_invariant=mode))  # the mode is process-wide: the last build
        res = compare(model, random.Random(7), cfg.vocab_size)
        res["decode_step_ms_b64_ctx512"] = decode_ms(model, cfg.vocab_size)
        result["invariant" if mode else "default"] = res
        print(f"batch_invariant={mode}:")
        for name, r in res.items():
            print(f"  {name}: {r}")
    result["fallbacks"] = fallback_counts()
    print("per-call fallbacks:", result["fallbacks"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(targets=targets(result), **result), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
