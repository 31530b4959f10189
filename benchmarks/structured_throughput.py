"""Throughput cost of constrained decoding on the CPU, through the engine (embedded model, 1 torch thread).

N requests constrained by a JSON schema run first; then the same prompts unconstrained, each forced to exactly the
length its constrained twin produced (min_tokens = max_tokens = that length: EOS is suppressed until then, and
ignore_eos stays off), so both runs generate the same number of tokens per request and only the grammar differs.
Each engine first serves one warm-up request of each kind (the grammar pool is built on the first so_args request
and the schema's first compile is cached), so the numbers are steady-state.

    python benchmarks/structured_throughput.py [--num-requests 32] [--mode both]
"""

from __future__ import annotations

import argparse
import random

from deepinfer import LLM
from deepinfer.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "age", "color", "tags"],
}


def run(mode: str, prompts: list[list[int]], temperature: float) -> dict:
    so_args = {"schema_type": "json", "schema": SCHEMA}
    engine = {"zero_overhead_scheduling": mode == "async"}
    with LLM(engine=engine, runtime={"num_threads": 1}) as llm:
        warm = [SamplingParams(max_tokens=8, seq_seed=1, so_args=so_args), SamplingParams(max_tokens=8, seq_seed=2)]
        llm.generate(prompt_token_ids=[[5, 6, 7]] * 2, sampling_params=warm, use_tqdm=False)

        constrained = [
            SamplingParams(temperature=temperature, max_tokens=512, seq_seed=i, so_args=so_args) for i in range(len(prompts))
        ]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=constrained, use_tqdm=False)
        assert all(o.finish_reason == "stop" for o in outs), [(o.finish_reason, o.error) for o in outs]
        grammar = llm.last_metrics

        lengths = [len(o.token_ids) for o in outs]
        free = [
            SamplingParams(temperature=temperature, max_tokens=n, min_tokens=n, seq_seed=i) for i, n in enumerate(lengths)
        ]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=free, use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == lengths
        plain = llm.last_metrics
    return {"tokens": sum(lengths), "grammar": grammar, "plain": plain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--mode", choices=("sync", "async", "both"), default="both")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    modes = ("sync", "async") if args.mode == "both" else (args.mode,)
    print(f"{args.num_requests} requests, prompt {args.prompt_len} tokens, temperature {args.temperature}, embedded model, 1 torch thread")
    print(f"{'mode':>5} {'tokens':>7} {'json tok/s':>11} {'plain tok/s':>12} {'json wall s':>12} {'plain wall s':>13} {'cost':>7}")
    for mode in modes:
        r = run(mode, prompts, args.temperature)
        g, p = r["grammar"], r["plain"]
        cost = g["wall_s"] / p["wall_s"] - 1
        print(
            f"{mode:>5} {r['tokens']:>7} {g['output_tokens_per_s']:>11.1f} {p['output_tokens_per_s']:>12.1f} "
            f"{g['wall_s']:>12.2f} {p['wall_s']:>13.2f} {cost:>+7.1%}"
        )


if __name__ == "__main__":
    main()
