#!/usr/bin/env python3
"""The prefill-size paths of the MoE and the FP8 projections against the decode kernels they replace from a
threshold, at V4.1-Flash shapes on the GPU (issue 20 items 1, 2): where each crosses over, what rate each reaches.

  source benchmarks/gpu_env.sh && python3 benchmarks/prefill_kernels_gpu.py --out $OUT/prefill_kernels.json

MoE (384 FP4 routed experts + one FP8 shared expert, hidden 5120, inter 2304, top-6, uniform random routing):
`stream` = moe_kernel's grouped GEMM (FP4 tiles dequantised in registers per token tile), `grouped` =
moe_prefill.py (experts dequantised to bf16 a chunk at a time, torch's grouped GEMM), at several token counts; the
rate is FLOPs (routed + shared) over time, and % of the bf16 GEMM rate measured in the same run. The two must
agree (relative error < 2e-2) or the script exits 1. FP8 projections: the weight-only kernel vs dequantise +
cuBLAS at several row counts for each projection shape. Timing: CUDA events, median of `--iters` calls.
"""

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import ceilings, timeit  # noqa: E402
from moe_gpu import HID, INTER, LIMIT, TOPK, E, make_experts  # noqa: E402

LINEARS = {  # name: (N, K) of V4.1-Flash's FP8 projections
    "wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_a group": (1024, 4096),
    "wo_b": (5120, 8192), "indexer wq_b": (4096, 1280),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def moe_rows(tokens_list, iters, peak):
    from deepinfer.kernels.tilelang import moe, moe_prefill

    g = torch.Generator(device="cuda").manual_seed(0)
    routed, shared = make_experts("cuda", g)
    rows = []
    for T_ in tokens_list:
        x = torch.randn(T_, HID, device="cuda", generator=g).bfloat16()
        logits = torch.randn(T_, E, device="cuda", generator=g)
        idx = logits.topk(TOPK, -1).indices
        w = torch.rand(T_, TOPK, device="cuda", generator=g)
        saved = moe_prefill.PREFILL_TOKENS
        try:
            moe_prefill.PREFILL_TOKENS = 1 << 30
            stream = lambda i: moe.moe_experts_packed(x, w, idx, routed, shared, LIMIT)  # noqa: E731
            ref = stream(0)
            ms_s = timeit(stream, iters=iters, warmup=2)[0]
            moe_prefill.PREFILL_TOKENS = 1
            grouped = lambda i: moe.moe_experts_packed(x, w, idx, routed, shared, LIMIT)  # noqa: E731
            got = grouped(0)
            ms_g = timeit(grouped, iters=iters, warmup=2)[0]
        finally:
            moe_prefill.PREFILL_TOKENS = saved
        flops = T_ * (TOPK + 1) * 3 * 2 * HID * INTER
        r = dict(tokens=T_, stream_ms=ms_s, grouped_ms=ms_g, err=rel(got, ref), finite=bool(torch.isfinite(got).all()),
                 stream_tflops=flops / ms_s / 1e9, grouped_tflops=flops / ms_g / 1e9,
                 stream_pct_peak=flops / ms_s / 1e-3 / peak * 100, grouped_pct_peak=flops / ms_g / 1e-3 / peak * 100)
        rows.append(r)
        print(f"MoE T={T_:6d}: stream {ms_s:8.2f} ms ({r['stream_tflops']:6.1f} TF/s) | grouped {ms_g:8.2f} ms "
              f"({r['grouped_tflops']:6.1f} TF/s, {r['grouped_pct_peak']:4.1f}% of bf16) | err {r['err']:.2e}",
              flush=True)
    # the dequant kernel alone: 32 experts' w13 (bytes read + written)
    out = moe_prefill.dense_rows("fp4", routed.w13[:32], routed.s13[:32], HID)
    ms = timeit(lambda i: moe_prefill.dense_rows("fp4", routed.w13[:32], routed.s13[:32], HID), iters=iters)[0]
    nbytes = routed.w13[:32].numel() + routed.s13[:32].numel() + out.numel() * 2
    from deepinfer.kernels.packed_experts import _dequant

    exact = all(torch.equal(out[e], _dequant("fp4", routed.w13[e], routed.s13[e]).bfloat16()) for e in (0, 31))
    print(f"fp4 dequant kernel: {ms:.3f} ms for 32 experts' w13, {nbytes / ms / 1e6:.0f} GB/s, exact {exact}")
    return rows, dict(ms=ms, gbs=nbytes / ms / 1e6, exact=exact)


def linear_rows(ms_list, iters):
    from deepinfer.kernels.fp8_weight import Fp8BlockWeight
    from deepinfer.kernels.tilelang.linear import dense_bf16, fp8_linear

    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for name, (n, k) in LINEARS.items():
        codes = (torch.randn(n, k, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
        scale = torch.randint(118, 124, (n // 32, k // 32), device="cuda", dtype=torch.uint8, generator=g)
        w = Fp8BlockWeight(codes, scale)
        for m in ms_list:
            x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            ms_k = timeit(lambda i: fp8_linear(x, w), iters=iters)[0]
            ms_d = timeit(lambda i: torch.nn.functional.linear(x, dense_bf16(w)), iters=iters)[0]
            err = rel(torch.nn.functional.linear(x, dense_bf16(w)), fp8_linear(x, w))
            fl = 2 * m * n * k
            rows.append(dict(name=name, n=n, k=k, m=m, kernel_ms=ms_k, dense_ms=ms_d, err=err,
                             kernel_tflops=fl / ms_k / 1e9, dense_tflops=fl / ms_d / 1e9))
            print(f"linear {name:12s} M={m:5d}: kernel {ms_k:7.3f} ms ({fl / ms_k / 1e9:6.1f} TF/s) | dequant+cuBLAS "
                  f"{ms_d:7.3f} ms ({fl / ms_d / 1e9:6.1f} TF/s) | err {err:.1e}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="prefill_kernels.json")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 8192])
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    t0 = time.time()
    bw, peak = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s", flush=True)
    moe, dq = moe_rows(a.tokens, a.iters, peak)
    lin = linear_rows(a.rows, a.iters)
    big = max(moe, key=lambda r: r["tokens"])
    best = max(big["stream_pct_peak"], big["grouped_pct_peak"])
    failures = [f"MoE T={r['tokens']}: paths disagree (rel err {r['err']:.2e}) or non-finite"
                for r in moe if not (r["err"] < 2e-2 and r["finite"])]
    failures += [f"linear {r['name']} M={r['m']}: rel err {r['err']:.2e}" for r in lin if not r["err"] < 1e-2]
    if not dq["exact"]:
        failures.append("fp4 dequant kernel differs from the torch dequantisation")
    tg = [dict(name=f"prefill MoE at {big['tokens']} tokens, % of the bf16 GEMM rate measured in the run",
               measured=best, target=55.0, unit="%", met=best >= 55.0)]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak,
                host=platform.node(), cmd=" ".join(sys.argv), wall_s=time.time() - t0)
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, targets=tg, moe=moe, dequant=dq, linear=lin, failures=failures), f, indent=1)
    for msg in failures:
        print("FAILED:", msg)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
