"""Prefill cost of YOCO bounded replay on the CPU: one prompt (2K tokens by default) through the embedded tiny model
with yoco off, mask and compact (deepinfer/models/replay.py).

Reports per mode and per chunking (the whole prompt in one step, and in chunks as the engine schedules them):
  - wall time of the prefill: median of --runs runs (after one warm-up; the modes take turns), one torch thread;
  - rows that went through the decoder layers (counted at each decoder layer's MoE), and rows saved against off;
  - matmul FLOPs of the whole prefill (torch.utils.flop_counter: mm/bmm/addmm ...; elementwise work is not
    counted) and the FLOPs saved against off.
mask computes every row (its windows are cut, not its rows): it costs what off costs. compact must save the
decoder layers' share of the rows before the last K tokens.

    python benchmarks/yoco_prefill.py [--tokens 2048] [--keep 140] [--chunk 512] [--runs 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from deepinfer.config.hardware import set_cpu_threads

ROOT = Path(__file__).resolve().parent.parent


def prefill(model, prompt: list[int], replay, chunk: int) -> torch.Tensor:
    from deepinfer.models import ForwardBatch

    state = model.new_state()
    logits = None
    for start in range(0, len(prompt), chunk):
        ids = prompt[start: start + chunk]
        logits = model.forward(ForwardBatch([ids], [state], replay=replay, data_lens=[len(prompt)]))
    state.free()
    return logits


def decoder_rows(model, run, boundary: int) -> int:
    """Rows through the decoder layers' MoE while run() runs (the layer hook says which layer is running)."""
    layer, rows, moe = [0], [0], model._moe

    def count(g, *rest):  # model._moe's own arguments (its FFN, layer, image rows) passed through
        rows[0] += g.shape[0] if layer[0] >= boundary else 0
        return moe(g, *rest)

    model.layer_hook, model._moe = (lambda i: layer.__setitem__(0, i)), count
    try:
        run()
    finally:
        model.layer_hook = None
        del model._moe
    return rows[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--keep", type=int, default=140, help="K (DeepInfer's V4.1-Flash value)")
    ap.add_argument("--chunk", type=int, default=512, help="the chunked run's chunk size")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "yoco_prefill_cpu.json"))
    args = ap.parse_args(argv)

    from deepinfer import embedded
    from deepinfer.models import load_model
    from deepinfer.models.replay import BoundedReplay, consumer_boundary

    set_cpu_threads(1)
    model = load_model(embedded.materialize("tiny-random"))
    cfg = model.config
    boundary = consumer_boundary(cfg)
    rng = random.Random(0)
    prompt = [rng.randrange(3, cfg.vocab_size - 16) for _ in range(args.tokens)]
    results = {}
    modes = ("off", "mask", "compact")
    replays = {m: BoundedReplay(cfg, m, args.keep) if m != "off" else None for m in modes}
    for chunk_name, chunk in (("one_step", args.tokens), (f"chunks_of_{args.chunk}", args.chunk)):
        rows = {}
        times = {m: [] for m in modes}
        with torch.inference_mode():
            for mode in modes:
                prefill(model, prompt, replays[mode], chunk)  # warm-up
            # round-robin over the modes: a shared machine's load drifts, and should drift on all of them alike
            for _ in range(args.runs):
                for mode in modes:
                    t0 = time.perf_counter()
                    prefill(model, prompt, replays[mode], chunk)
                    times[mode].append(time.perf_counter() - t0)
            for mode in modes:
                replay = replays[mode]
                n_rows = decoder_rows(model, lambda: prefill(model, prompt, replay, chunk), boundary)
                counter = FlopCounterMode(display=False)
                with counter:
                    prefill(model, prompt, replay, chunk)
                rows[mode] = {"median_s": statistics.median(times[mode]), "runs_s": times[mode],
                              "decoder_rows": n_rows, "matmul_flops": counter.get_total_flops()}
        off = rows["off"]
        for r in rows.values():
            r["decoder_rows_saved"] = off["decoder_rows"] - r["decoder_rows"]
            r["matmul_flops_saved"] = off["matmul_flops"] - r["matmul_flops"]
            r["flops_saved_fraction"] = r["matmul_flops_saved"] / off["matmul_flops"]
            r["speedup_vs_off"] = off["median_s"] / r["median_s"]
        results[chunk_name] = rows
    out = {
        "command": "python benchmarks/yoco_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": f"embedded tiny ({cfg.num_hidden_layers} layers, decoder layers {boundary}..{cfg.num_hidden_layers - 1}, "
                 f"hidden {cfg.hidden_size}, sliding window {cfg.sliding_window})",
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}, 1 thread",
        "tokens": args.tokens,
        "keep_tokens": args.keep,
        "results": results,
        "targets": [],  # issue 12 names no target; issue 20's compact >= 1.8x off at 32K is prefill_gpu.py's (H200)
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for chunk_name, rows in results.items():
        for mode, r in rows.items():
            print(f"{chunk_name:>14} {mode:>8}: {r['median_s'] * 1e3:8.1f} ms  x{r['speedup_vs_off']:.2f} vs off  "
                  f"decoder rows {r['decoder_rows']:6d} (saved {r['decoder_rows_saved']})  matmul GFLOP "
                  f"{r['matmul_flops'] / 1e9:.3f} (saved {100 * r['flops_saved_fraction']:.1f}%)")
    print(f"written {Path(args.out).relative_to(ROOT) if Path(args.out).is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
