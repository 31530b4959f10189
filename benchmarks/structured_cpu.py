"""Per-step CPU cost of structured-output masks vs unconstrained sampling (vocab 512 fixture tokenizer).

Prints, per batch size, the milliseconds per step of: unconstrained sampling; building the grammar bitmask (what
the engine overlaps with the model's forward); sampling with the mask applied plus advancing the matchers.
Requests restart when their grammar finishes, so every step measures live matchers. The engine-level throughput
cost is measured separately, with the model in the loop.

    python benchmarks/structured_cpu.py [--steps 200] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepinfer.config.hardware import set_cpu_threads
from deepinfer.sampling import SampleRow, Sampler, SamplingParams
from deepinfer.sampling.grammar import GrammarCompilerPool

TOKENIZER = Path(__file__).parents[1] / "tests/fixtures/deepseek_v41/tiny-engram-hc4/tokenizer.json"
VOCAB, EOS = 512, 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    },
    "required": ["name", "age", "color", "tags"],
}


def run(batch: int, steps: int, pool: GrammarCompilerPool, sampler: Sampler) -> tuple[float, float, float]:
    so_args = {"schema_type": "json", "schema": SCHEMA}
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10_000)
    states = [pool.compile(so_args) for _ in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, VOCAB, generator=g) * 2 for _ in range(steps)]
    plain_rows = [SampleRow(params, i, 0) for i in range(batch)]

    t0 = time.perf_counter()
    for step in range(steps):
        sampler.sample(logits[step], plain_rows)
    plain = time.perf_counter() - t0

    mask_time = sample_time = 0.0
    for step in range(steps):
        rows = [SampleRow(params, i, len(outputs[i]), outputs[i], [], states[i]) for i in range(batch)]
        t0 = time.perf_counter()
        bitmask = sampler.build_bitmask(rows, VOCAB)
        t1 = time.perf_counter()
        outs = sampler.sample(logits[step], rows, token_bitmask=bitmask)
        t2 = time.perf_counter()
        mask_time, sample_time = mask_time + (t1 - t0), sample_time + (t2 - t1)
        for i, out in enumerate(outs):
            assert out.error is None, out.error
            outputs[i].append(out.token_id)
            if states[i].is_terminated():
                states[i], outputs[i] = pool.compile(so_args), []  # a cache hit: restart the request
    ms = 1000.0 / steps
    return plain * ms, mask_time * ms, sample_time * ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batches", default="1,8,32")
    args = parser.parse_args()
    set_cpu_threads(1)
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    sampler = Sampler(VOCAB, EOS, tokenizer=tokenizer)
    with GrammarCompilerPool.for_tokenizer(tokenizer, VOCAB, EOS) as pool:
        t0 = time.perf_counter()
        pool.compile({"schema_type": "json", "schema": SCHEMA})
        print(f"first compile (uncached): {1000 * (time.perf_counter() - t0):.1f} ms; vocab {VOCAB}, 1 torch thread")
        print(f"{'batch':>5} {'plain ms/step':>14} {'mask ms/step':>13} {'masked sample ms/step':>22} {'overhead':>9}")
        for batch in (int(b) for b in args.batches.split(",")):
            plain, mask, masked = run(batch, args.steps, pool, sampler)
            overhead = (mask + masked) / plain
            print(f"{batch:>5} {plain:>14.3f} {mask:>13.3f} {masked:>22.3f} {overhead:>8.2f}x")


if __name__ == "__main__":
    main()
