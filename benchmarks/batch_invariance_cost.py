"""What the CPU backend's row-invariance tricks cost: the embedded model's decode step (batch 1, 8, 64) and a
512-token prefill, as shipped versus with the tricks switched off (one torch thread).

The tricks (what makes a row's logits independent of its batch, see kernels/torch): GEMM inputs padded to
ROW_TILE = 16 rows (`linear.ROW_TILE`), and transcendentals evaluated on whole SIMD blocks (`elementwise.ew`).
Switching them off is done here only, by monkeypatching the modules the model calls: ROW_TILE = 1 (no padding)
and `ew(fn, x)` replaced by a plain `fn(x)` where mhc, moe, engram and rope imported it.

    python benchmarks/batch_invariance_cost.py [--repeats 7] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import deepinfer.kernels.torch.elementwise as elementwise
import deepinfer.kernels.torch.engram as engram
import deepinfer.kernels.torch.linear as linear
import deepinfer.kernels.torch.mhc as mhc
import deepinfer.kernels.torch.moe as moe
import deepinfer.kernels.torch.rope as rope
from deepinfer import embedded
from deepinfer.config.hardware import set_cpu_threads
from deepinfer.models import ForwardBatch, load_model

EW_USERS = (mhc, moe, engram, rope)
SHIPPED_ROW_TILE = linear.ROW_TILE


def plain_ew(fn, x):
    return fn(x)


def set_tricks(on: bool) -> None:
    linear.ROW_TILE = SHIPPED_ROW_TILE if on else 1
    for module in EW_USERS:
        module.ew = elementwise.ew if on else plain_ew


def decode_ms(model, batch: int, steps: int, context: int) -> float:
    """Median ms of one decode step of `batch` sequences that already hold `context` tokens."""
    states = [model.new_state() for _ in range(batch)]
    model.forward(ForwardBatch([[3 + (i + j) % 500 for j in range(context)] for i in range(batch)], states))
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        model.forward(ForwardBatch([[3 + (i + s) % 500] for i in range(batch)], states))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def prefill_ms(model, tokens: int, repeats: int) -> float:
    ids = [3 + j % 500 for j in range(tokens)]
    times = []
    for _ in range(repeats):
        state = model.new_state()
        t0 = time.perf_counter()
        model.forward(ForwardBatch([ids], [state]))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="rounds; each measures every case with tricks on and off")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--context", type=int, default=64, help="tokens each decoding sequence holds before timing")
    args = ap.parse_args()
    set_cpu_threads(1)
    model = load_model(embedded.materialize("tiny-random"))
    cases = [(f"decode batch {b}", lambda b=b: decode_ms(model, b, args.decode_steps, args.context)) for b in (1, 8, 64)]
    cases.append(("prefill 512 tokens", lambda: prefill_ms(model, 512, 1)))
    results = {name: {True: [], False: []} for name, _ in cases}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both sides alike
        for name, measure in cases:
            for on in (True, False):
                set_tricks(on)
                results[name][on].append(measure())
    set_tricks(True)
    print(f"embedded model, 1 torch thread, median of {args.repeats} rounds (decode: median of {args.decode_steps} steps)")
    print(f"{'case':>20} {'invariant ms':>13} {'plain ms':>9} {'cost':>7}")
    for name, _ in cases:
        on, off = statistics.median(results[name][True]), statistics.median(results[name][False])
        print(f"{name:>20} {on:>13.2f} {off:>9.2f} {on / off - 1:>+7.1%}")


if __name__ == "__main__":
    main()
