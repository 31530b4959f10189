"""The routed experts a decode step of a benchmark model touches, measured against what roofline.py's floor counts.

roofline.py counts E(1 - (1 - k/E)^B) distinct routed experts for a B-token step: uniform, independent routing, as a
trained router balanced by its selection bias gives. The synthetic benchmark models drew that bias at random until
the thirty-ninth session (N(0, 0.2) beside sqrt-softplus scores of spread ~0.3), which favoured some experts in every
token's choice: a step read fewer expert weights than the floor counts, and % of the roofline overstated (the
40-layer model's B=64 step passed 100% on an H100); random_weights.SELECTION_BIAS is zero since. This measures
it: the model's own forward, eager, B sequences
of a short random prompt, then one decode step of B rows; every moe_router call of that step records how many
distinct experts its B tokens chose. `routed_floor` is the step's floor with those counts in place of the uniform
ones (the same bytes otherwise), so a row can say both.

Used by decode_gpu.py (--routing); tested on the CPU (tests/test_routing_spread.py). Run alone, it counts on the
6-layer Flash-width benchmark model with narrow experts (the router's inputs keep their width; the CPU fits it), with
the selection bias as the benchmark models now have it (zero) and as they had it (drawn N(0, 0.2)):

    python benchmarks/routing_spread.py --batches 8 64 --out benchmarks/results/routing_spread_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from roofline import FP4  # the routed experts' bytes per weight (benchmarks/ is this script's directory)

EVEN = 0.9  # distinct experts over roofline.py's uniform count that a benchmark model's step must reach


@contextlib.contextmanager
def recording_router(model):
    """Within: every model.ops.moe_router call appends (tokens, distinct experts) to the yielded list."""
    ops = model.ops
    inner = ops.moe_router
    calls: list[tuple[int, int]] = []

    def moe_router(g, *args, **kwargs):
        weights, idx = inner(g, *args, **kwargs)
        calls.append((idx.shape[0], int(torch.unique(idx).numel())))
        return weights, idx

    ops.moe_router = moe_router  # an instance attribute: found before OpSet.__getattr__
    try:
        yield calls
    finally:
        del ops.moe_router


def routed_experts(model, batch: int, context: int = 64, seed: int = 0) -> list[int]:
    """Distinct experts per MoE call of one decode step of `batch` rows (each after a `context`-token random
    prompt): one count per moe_router call of that step (the backbone's MoE layers, in order)."""
    from deepinfer.models import ForwardBatch
    from deepinfer.models.cache import SequenceCache

    bs = 64
    per_seq = -(-(context + 1) // bs)
    pools = model.allocate_cache(num_slots=batch, num_blocks=batch * per_seq + 1, block_size=bs)
    states = [SequenceCache(pools, s, list(range(s * per_seq, (s + 1) * per_seq))) for s in range(batch)]
    g = torch.Generator().manual_seed(seed + batch)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, min(500, vocab), (batch, context), generator=g).tolist()
    with torch.inference_mode():
        logits = model.forward(ForwardBatch(prompts, states))
        nxt = logits.argmax(-1).tolist()
        with recording_router(model) as calls:
            model.forward(ForwardBatch([[t] for t in nxt], states))
    counts = [n for tokens, n in calls if tokens == batch]
    if not counts:
        raise RuntimeError(f"routing_spread: no moe_router call of {batch} tokens in the decode step")
    return counts


def uniform_experts(c: dict, tokens: int) -> float:
    """roofline.py's distinct routed experts of a `tokens`-token step (uniform routing)."""
    E, k = c["n_routed_experts"], c["num_experts_per_tok"]
    return E * (1 - (1 - k / E) ** tokens)


def routed_floor(c: dict, roof: dict, bw: float, batch: int, counts: list[int]) -> dict:
    """The step floor (roof: decode_gpu.step_roofline's) with each MoE layer's measured distinct experts in place
    of the uniform count: the bytes of the experts the step did not touch taken off. Layers beyond the measured
    calls keep the uniform count."""
    per_expert = 3 * c["hidden_size"] * c["moe_intermediate_size"] * FP4
    unused = sum(uniform_experts(c, batch) - n for n in counts) * per_expert
    by = roof["bytes"] - unused
    bw_ms = by / bw * 1e3
    return dict(bytes=by, floor_ms=max(bw_ms, roof["compute_ms"]), bw_ms=bw_ms,
                experts_measured=sum(counts) / len(counts), experts_uniform=uniform_experts(c, batch),
                moe_calls=len(counts))


def targets(rows: list[dict]) -> list[dict]:
    """The JSON's `targets`: issue 20's premise that the benchmark models move the released model's bytes, here its
    routed experts: each batch's distinct experts with the bias as the models have it (zero) over the uniform count,
    at least EVEN."""
    return [dict(name=f"benchmark model's distinct routed experts at B={r['batch']}, over roofline.py's uniform count",
                 measured=round(r["mean"] / r["uniform"], 3), target=EVEN, unit="x uniform",
                 met=r["mean"] / r["uniform"] >= EVEN) for r in rows if r["bias"] == "zero"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--context", type=int, default=16, help="prompt tokens before the decode step")
    ap.add_argument("--expert-width", type=int, default=64, help="moe_intermediate_size (the release: 2304)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from deepinfer.models import synthetic

    cfg = synthetic.config({"moe_intermediate_size": a.expert_width, "vocab_size": 4096, "engram_layer_ids": []})
    model = synthetic.build_model(cfg, a.device, torch.bfloat16, backends=["torch"])
    c = dict(n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok)
    gates = [lw.ffn.gate.bias for lw in model.layers]
    g = torch.Generator(device=gates[0].device).manual_seed(0)
    drawn = [torch.randn(b.shape, generator=g, device=b.device) * 0.2 for b in gates]  # fixture_init's draw
    rows = []
    for bias in ("zero", "drawn"):
        for b, d in zip(gates, drawn):
            b.copy_(d if bias == "drawn" else torch.zeros_like(d))
        for batch in a.batches:
            t0 = time.time()
            counts = routed_experts(model, batch, a.context)
            rows.append(dict(bias=bias, batch=batch, counts=counts, mean=sum(counts) / len(counts),
                             uniform=uniform_experts(c, batch)))
            print(f"bias {bias:5s} B={batch:<4d} distinct experts per MoE layer {counts}: mean {rows[-1]['mean']:.1f}"
                  f" (uniform {rows[-1]['uniform']:.1f})  [{time.time() - t0:.0f} s]", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            config = dict(expert_width=a.expert_width, context=a.context, layers=cfg.num_hidden_layers,
                          hidden=cfg.hidden_size, experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok)
            json.dump(dict(targets=targets(rows), config=config, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
