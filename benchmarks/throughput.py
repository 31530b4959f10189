"""Offline throughput: N requests with random prompt and output lengths, all submitted at once (nano-vllm's shape:
256 requests, lengths 100..1024, ignore_eos) on the embedded model.

Reports output tokens/s, and for each scheduling mode the device idle gap between consecutive steps and the share
of step time spent in Python scheduling/bookkeeping. Every number printed names the command that produced it.

    python benchmarks/throughput.py                                  # the full shape (slow on a CPU)
    python benchmarks/throughput.py --num-requests 64 --max-len 256  # a CPU-sized run
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
    ap.add_argument("--model", default="embedded:tiny-random",
                    help="embedded:tiny-random (the test model the recorded numbers used), embedded:tiny or a directory")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100, help="shortest prompt and output length")
    ap.add_argument("--max-len", type=int, default=1024, help="longest prompt and output length")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--memory-budget", type=int, default=None, help="cache bytes (default: what the model leaves of cache.memory_fraction of the device's memory)")
    ap.add_argument("--mode", choices=("async", "sync", "both"), default="both")
    ap.add_argument("--process", choices=("subprocess", "inproc"), default="subprocess")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the same workload on the GPU: bf16, CUDA graphs)")
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the engine process (runtime.num_threads; 0: torch's default)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    return ap.parse_args(argv)


def workload(args, vocab: int):
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(args.num_requests)]
    out_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_requests)]
    return prompts, out_lens


def settings_for(args, zero_overhead: bool):
    """The run's resolved Settings (the engine is built from them, as LLM and the server build theirs): the CPU, or
    on CUDA the detected GPU's hardware option; the cache limit is cache.memory_fraction of the device's memory
    (the resolve step's) unless --memory-budget names the bytes."""
    from deepinfer.api import load_settings, overrides_for

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return load_settings(overrides_for(
        args.model,
        hardware="cpu" if args.device == "cpu" else "auto",
        dtype=dtype,
        process=args.process,
        zero_overhead_scheduling=zero_overhead,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2 * args.max_len + 1,
        memory_budget=args.memory_budget,
        runtime={"num_threads": args.threads or None},
    ))


def run_mode(args, zero_overhead: bool) -> dict:
    from deepinfer.frontend import LLMEngine
    from deepinfer.sampling import SamplingParams

    with LLMEngine.for_settings(settings_for(args, zero_overhead)) as engine:
        prompts, out_lens = workload(args, engine.info.vocab_size)
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seq_seed=i) for i, n in enumerate(out_lens)]
        engine.generate([[0, 5]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outputs = engine.generate(prompts, params, use_tqdm=True)
        wall = time.perf_counter() - t0
        m = engine.last_metrics
        bad = [o.error for o in outputs if o.finish_reason == "error"]
        if bad:
            raise SystemExit(f"{len(bad)} requests failed, e.g.: {bad[0]}")
        return {
            "mode": "async" if zero_overhead else "sync",
            "device": args.device,
            "graph_steps": m.get("graph_steps", 0),
            "cache": engine.info.cache_description,
            "output_tokens": m["generated_tokens"],
            "wall_s": wall,
            "output_tokens_per_s": m["generated_tokens"] / wall,
            "prefill_tokens_per_s": m["prefill_tokens_per_s"],
            "decode_tokens_per_s": m["decode_tokens_per_s"],
            "steps": m["steps"],
            "mean_rows_per_step": m["mean_rows_per_step"],
            "step_gap_ms_p50": 1e3 * m["step_gap_s"]["p50"],
            "step_gap_ms_mean": 1e3 * m["step_gap_s"]["mean"],
            "scheduling_share": m["scheduling_share"],
            "scheduling_ms_per_step": 1e3 * (m["scheduling_cpu_s"] + m["runner_prepare_s"]) / max(1, m["steps"]),
            "device_ms_per_step": 1e3 * m["device_busy_s"] / max(1, m["steps"]),
            "ttft_s_p50": m["ttft_s"]["p50"],
            "itl_ms_p50": 1e3 * m["itl_s"]["p50"],
            "itl_ms_p99": 1e3 * m["itl_s"]["p99"],
            "preemptions": m["preemptions"],
            "cache_utilization_peak": m["cache_utilization"]["peak"],
        }


SCHEDULING_SHARE = 10.0  # issue 4: scheduling under 10% of step time at batch 64 on the CPU
GPU_IDLE = 5.0  # issue 10: GPU idle between steps <= 5% of step time with async scheduling


def targets(results: list[dict], max_num_seqs: int) -> list[dict]:
    """Issue 4's and issue 10's bounds on what a row measured. Issue 10's other throughput.py targets compare two
    runs (the H200 against the CPU; this commit against the previous one): no single run measures them."""
    out = []
    for r in results:
        if r["device"] == "cpu" and max_num_seqs == 64:
            got = 100 * r["scheduling_share"]
            out.append(dict(name=f"{r['mode']} scheduling: bookkeeping share of step time, max_num_seqs 64 (CPU)",
                            measured=round(got, 2), target=SCHEDULING_SHARE, unit="%", met=got < SCHEDULING_SHARE))
        elif r["device"] != "cpu" and r["mode"] == "async":
            got = 100 * r["step_gap_ms_mean"] / r["device_ms_per_step"]
            out.append(dict(name="async scheduling: GPU idle between steps, % of step time (mean gap / mean step)",
                            measured=round(got, 2), target=GPU_IDLE, unit="%", met=got <= GPU_IDLE))
    return out


def main(argv=None):
    args = parse_args(argv)
    modes = {"async": [True], "sync": [False], "both": [False, True]}[args.mode]
    command = "python benchmarks/throughput.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results = [run_mode(args, zo) for zo in modes]
    print(f"\n# {command}")
    for r in results:
        print(
            f"{r['mode']:>5}: {r['output_tokens_per_s']:.1f} output tok/s ({r['output_tokens']} tokens in {r['wall_s']:.1f} s, "
            f"{r['steps']} steps, {r['mean_rows_per_step']:.1f} rows/step); step gap p50 {r['step_gap_ms_p50']:.3f} ms "
            f"mean {r['step_gap_ms_mean']:.3f} ms; scheduling {100 * r['scheduling_share']:.1f}% of step time "
            f"({r['scheduling_ms_per_step']:.2f} ms of {r['device_ms_per_step']:.1f} ms/step); "
            f"ttft p50 {r['ttft_s_p50']:.2f} s; itl p50 {r['itl_ms_p50']:.1f} ms; preemptions {r['preemptions']}"
            + (f"; {r['graph_steps']} of {r['steps']} steps replayed a CUDA graph" if r["device"] != "cpu" else "")
        )
    if args.json:
        tg = targets(results, args.max_num_seqs)
        if args.device != "cpu":  # issue 10's targets are the H200's
            import torch
            from target_card import on_card  # benchmarks/, this script's folder

            tg = on_card(tg, torch.cuda.get_device_name(args.device))
        with open(args.json, "w") as f:
            json.dump({"command": command, "targets": tg, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
