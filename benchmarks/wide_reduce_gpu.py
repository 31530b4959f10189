#!/usr/bin/env python3
"""The vocabulary-wide argmax and max (deepinfer/sampling/wide_reduce.py) against torch's one-pass reductions on
the same GPU: [rows, 129280] fp32 logits (V4.1's vocabulary), the time a call takes inside a CUDA graph (as the
DSpark drafting graphs run it; the sampler runs them eagerly), medians of CUDA-event timed replays of a graph holding
20 calls on distinct inputs. Each result is checked equal to torch's first (exit 1 if not: a faster wrong answer is
no result).

    python3 benchmarks/wide_reduce_gpu.py [--rows 1 8 64] [--out benchmarks/results/wide_reduce_gpu.json]
"""

import argparse
import json
import statistics
import sys

import torch

from deepinfer.sampling.wide_reduce import first_argmax, row_max

VOCAB, CALLS, REPLAYS = 129280, 20, 25


def graph_us(fn, inputs) -> float:
    """Per-call microseconds of fn over `inputs` captured once in a CUDA graph, median of REPLAYS replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs[:3]:
            fn(x)  # warm-up off the capture (workspace, lazy init)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in inputs:
            fn(x)
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(inputs))
    return statistics.median(times)


def gpu_args(doc: str, argv=None) -> argparse.Namespace:
    """--rows and --out of a micro-benchmark of this kind; a machine without a GPU is a usage error (exit 2)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("a GPU is needed")
    return a


def finish(out: dict, wrong: list[str], path: str | None, failure: str) -> int:
    """Write out (its failures included) to path, and the exit status: 1, with one line, when a check failed."""
    out["failures"] = wrong
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    if wrong:
        print(f"FAILED: {failure}: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    a = gpu_args(__doc__, argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__, vocab=VOCAB, calls=CALLS),
               rows=[], targets=[])
    wrong = []
    for n in a.rows:
        # integers in [-3, 3]: ties everywhere, so the lowest-index rule is exercised, not just the values
        inputs = [torch.randint(-3, 4, (n, VOCAB), device="cuda", generator=g).float() for _ in range(CALLS)]
        for name, ours, theirs in (("argmax", first_argmax, lambda x: x.argmax(dim=-1)),
                                   ("max", row_max, lambda x: x.max(dim=-1).values)):
            if not all(torch.equal(ours(x), theirs(x)) for x in inputs):
                wrong.append(f"{name} rows={n}")
            t_ours, t_torch = graph_us(ours, inputs), graph_us(theirs, inputs)
            out["rows"].append(dict(op=name, rows=n, us=t_ours, torch_us=t_torch, speedup=t_torch / t_ours,
                                    gb_s=n * VOCAB * 4 / t_ours / 1e3))
            print(f"{name:6s} rows={n:3d}: two-pass {t_ours:6.1f} us, torch {t_torch:6.1f} us "
                  f"({t_torch / t_ours:.2f}x), {n * VOCAB * 4 / t_ours / 1e3:.0f} GB/s")
    return finish(out, wrong, a.out, "not torch's result")


if __name__ == "__main__":
    sys.exit(main())
