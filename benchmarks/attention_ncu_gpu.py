#!/usr/bin/env python3
"""The decode attention kernel at one shape, a few calls, for Nsight Compute to read its counters
(benchmarks/device/attention_ncu.sh runs it under `ncu`): where the one-split kernel's time goes, which timing
probes (attention_decode_gpu.py --probes) can only infer by difference.

    source benchmarks/gpu_env.sh && python3 benchmarks/attention_ncu_gpu.py [--batch 2048] [--ctx 32768] \
        [--probe blocks1] [--calls 3]

Inputs are attention_decode_gpu.py's (kernels_gpu.attention_inputs: full FP8 window rings, a ratio-2 FP4 pool, 512
random selected rows a query); --batch 2048 at one split is the shape of a prefill chunk's queries, one CTA a query.
The first call compiles; the profiler takes a later one (ncu --launch-skip). Exits 1 when the kernel did not run
with the split count asked (the profile would be of another kernel)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import ITOPK, WIN, attention_inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2048, help="query tokens, one a sequence")
    ap.add_argument("--ctx", type=int, default=32768, help="context of each sequence")
    ap.add_argument("--splits", type=int, default=1, help="key splits a query (1: prefill's shape)")
    ap.add_argument("--probe", default="", help="attention_decode_kernel.PROBES entry (default: the kernel)")
    ap.add_argument("--calls", type=int, default=3, help="calls after the compiling one")
    a = ap.parse_args()

    from deepinfer.kernels.tilelang import attention
    from deepinfer.kernels.tilelang.attention_decode_kernel import PROBES

    if a.probe not in PROBES:
        raise SystemExit(f"--probe must be one of {PROBES}, got {a.probe!r}")
    g = torch.Generator(device="cuda").manual_seed(1)
    data = attention_inputs(a.batch, a.ctx, 1, g)[0]
    sink = torch.randn(64, device="cuda", generator=g)
    blocks = (WIN + ITOPK) // attention.BLOCK_KEYS
    used = attention.used_splits(a.splits, blocks)
    if used != a.splits:
        print(f"attention_ncu_gpu: {a.splits} splits of {blocks} blocks run as {used}; ask for {used}",
              file=sys.stderr)
        return 1
    for _ in range(1 + a.calls):
        out = attention.sink_attention_decode_kernel(*data, sink, 512 ** -0.5, splits=a.splits, probe=a.probe)
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(out.float()).all()) or bool(a.probe)
    print(f"attention_ncu_gpu: B={a.batch} ctx={a.ctx} splits={a.splits} probe={a.probe or '-'}: "
          f"{1 + a.calls} calls, output {'finite' if ok else 'NOT FINITE'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
