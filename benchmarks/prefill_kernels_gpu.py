#!/usr/bin/env python3
"""The prefill-size paths of the MoE and the FP8 projections against the decode kernels they replace from a
threshold, at V4.1-Flash shapes on the GPU (issue 20 items 1, 2): where each crosses over, what rate each reaches.

  source benchmarks/gpu_env.sh && python3 benchmarks/prefill_kernels_gpu.py --out $OUT/prefill_kernels.json

MoE (384 FP4 routed experts + one FP8 shared expert, hidden 5120, inter 2304, top-6, uniform random routing):
`stream` = moe_kernel's grouped GEMM (FP4 tiles dequantised in registers per token tile), `grouped` =
moe_prefill.py (tokens grouped by expert into tiles of BLOCK_M rows, expert_gemm_kernel's FP4 grouped GEMM for
gate/up with the SwiGLU epilogue and for down, moe_combine_kernel), at several token counts and `--block-m` tile
heights; the rate is FLOPs (routed + shared) over time, and % of the bf16 GEMM rate measured in the same run.
The two must agree (relative error < 2e-2) or the script exits 1. Then the grouped GEMM kernel alone per
projection, every expert with 128 or 256 rows, in tiles of each `--gemm-heights` rows. FP8 projections: the weight-only
kernel vs dequantise + cuBLAS at several row counts for each projection shape. Timing: CUDA events, median of
`--iters` calls. `--profile T`: the kernel table of one grouped MoE call of T tokens instead.
"""

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_gpu import portable_json  # noqa: E402
from kernels_gpu import ceilings, timeit  # noqa: E402
from moe_gpu import HID, INTER, LIMIT, TOPK, E, make_experts  # noqa: E402
from target_card import on_card  # noqa: E402

LINEARS = {  # name: (N, K) of V4.1-Flash's FP8 projections
    "wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_a group": (1024, 4096),
    "wo_b": (5120, 8192), "indexer wq_b": (4096, 1280),
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def moe_rows(tokens_list, iters, peak, block_ms=(128,), heights=(128,)):
    from deepinfer.kernels.tilelang import moe, moe_prefill

    g = torch.Generator(device="cuda").manual_seed(0)
    routed, shared = make_experts("cuda", g)
    rows = []
    for T_ in tokens_list:
        x = torch.randn(T_, HID, device="cuda", generator=g).bfloat16()
        logits = torch.randn(T_, E, device="cuda", generator=g)
        idx = logits.topk(TOPK, -1).indices
        w = torch.rand(T_, TOPK, device="cuda", generator=g)
        saved = moe_prefill.PREFILL_TOKENS, moe_prefill.BLOCK_M
        by_bm = {}
        try:
            moe_prefill.PREFILL_TOKENS = 1 << 30
            stream = lambda i: moe.moe_experts_packed(x, w, idx, routed, shared, LIMIT)  # noqa: E731
            ref = stream(0)
            ms_s = timeit(stream, iters=iters, warmup=2)[0]
            moe_prefill.PREFILL_TOKENS = 1
            grouped = lambda i: moe.moe_experts_packed(x, w, idx, routed, shared, LIMIT)  # noqa: E731
            errs, finite = [], True
            for bm in block_ms:  # every tile height checked against the stream
                moe_prefill.BLOCK_M = bm
                got = grouped(0)
                errs.append(rel(got, ref))
                finite = finite and bool(torch.isfinite(got).all())
                by_bm[bm] = timeit(grouped, iters=iters, warmup=2)[0]
            ms_g = by_bm[saved[1]] if saved[1] in by_bm else by_bm[block_ms[-1]]
        finally:
            moe_prefill.PREFILL_TOKENS, moe_prefill.BLOCK_M = saved
        if len(by_bm) > 1:
            times = ", ".join(f"{bm}: {ms:.2f} ms" for bm, ms in by_bm.items())
            print(f"MoE T={T_:6d}: grouped by tile height {times}", flush=True)
        flops = T_ * (TOPK + 1) * 3 * 2 * HID * INTER
        r = dict(tokens=T_, stream_ms=ms_s, grouped_ms=ms_g, grouped_ms_by_block_m=by_bm, err=max(errs),
                 finite=finite,
                 stream_tflops=flops / ms_s / 1e9, grouped_tflops=flops / ms_g / 1e9,
                 stream_pct_peak=flops / ms_s / 1e-3 / peak * 100, grouped_pct_peak=flops / ms_g / 1e-3 / peak * 100)
        rows.append(r)
        print(f"MoE T={T_:6d}: stream {ms_s:8.2f} ms ({r['stream_tflops']:6.1f} TF/s) | grouped {ms_g:8.2f} ms "
              f"({r['grouped_tflops']:6.1f} TF/s, {r['grouped_pct_peak']:4.1f}% of bf16) | err {r['err']:.2e}",
              flush=True)
    # the grouped GEMM kernel alone, both projections, every expert with 128 or 256 rows, per tile height
    alone = []
    for bm in heights:
        for per in (1, 2):
            tile_expert = torch.arange(E, dtype=torch.int32, device="cuda").repeat_interleave(per * 128 // bm)
            rows_n = tile_expert.numel() * bm
            aw = torch.rand(rows_n, device="cuda", generator=g)
            for which, epi, k in (("w13", "swiglu", HID), ("w2", "plain", INTER)):
                a_ = torch.randn(rows_n, k, device="cuda", generator=g).bfloat16()
                ms = timeit(lambda i: moe_prefill.expert_gemm(a_, tile_expert, routed, which, aw, epi, LIMIT, bm),
                            iters=iters)[0]
                fl = 2 * rows_n * k * (2 * INTER if which == "w13" else HID)
                alone.append(dict(height=bm, proj=which, rows=rows_n, ms=ms, tflops=fl / ms / 1e9,
                                  pct_peak=fl / ms / 1e-3 / peak * 100))
                print(f"fp4 expert GEMM, {bm:3d}-row tiles, {which} rows={rows_n:6d}: {ms:7.3f} ms ({fl / ms / 1e9:6.1f} TF/s, "
                      f"{fl / ms / 1e-3 / peak * 100:4.1f}% of bf16)", flush=True)
    return rows, alone


def profile_moe(tokens: int) -> int:
    """One grouped MoE call under the profiler: its kernels by time, so the glue around the GEMMs is visible."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.kernels.tilelang import moe_prefill

    g = torch.Generator(device="cuda").manual_seed(0)
    routed, shared = make_experts("cuda", g)
    x = torch.randn(tokens, HID, device="cuda", generator=g).bfloat16()
    idx = torch.randn(tokens, E, device="cuda", generator=g).topk(TOPK, -1).indices
    w = torch.rand(tokens, TOPK, device="cuda", generator=g)
    call = lambda: moe_prefill.moe_experts_grouped(x, w, idx, routed, shared, LIMIT)  # noqa: E731
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    evs = [(ev.device_time_total / 1e3, ev.count, ev.key) for ev in prof.key_averages() if ev.device_time_total > 0]
    total = sum(ms for ms, _, _ in evs)
    print(f"grouped MoE of {tokens} tokens: {total:.2f} ms of kernel time")
    for ms, n, key in sorted(evs, reverse=True)[:25]:
        print(f"  {ms:8.3f} ms {n:4d}x  {key[:110]}")
    return 0


def linear_rows(ms_list, iters, block_ts=(32,)):
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
            ms_d = timeit(lambda i: torch.nn.functional.linear(x, dense_bf16(w)), iters=iters)[0]
            fl = 2 * m * n * k
            for bt in block_ts:  # the kernel at each token tile: same math, so the same bits are required
                ms_k = timeit(lambda i: fp8_linear(x, w, block_t=bt), iters=iters)[0]
                err = rel(torch.nn.functional.linear(x, dense_bf16(w)), fp8_linear(x, w, block_t=bt))
                same = bool(torch.equal(fp8_linear(x, w, block_t=bt), fp8_linear(x, w)))
                rows.append(dict(name=name, n=n, k=k, m=m, block_t=bt, kernel_ms=ms_k, dense_ms=ms_d, err=err,
                                 same_bits_as_default_tile=same, kernel_tflops=fl / ms_k / 1e9,
                                 dense_tflops=fl / ms_d / 1e9))
                print(f"linear {name:12s} M={m:5d} bt{bt:<2d}: kernel {ms_k:7.3f} ms ({fl / ms_k / 1e9:6.1f} TF/s) | "
                      f"dequant+cuBLAS {ms_d:7.3f} ms ({fl / ms_d / 1e9:6.1f} TF/s) | err {err:.1e}"
                      f"{'' if same else ' | bits differ from the 32-token tile'}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="prefill_kernels.json")
    ap.add_argument("--tokens", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096, 8192],
                    help="MoE token counts (none: the projections only)")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 8192])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--block-m", type=int, nargs="+", default=[64], help="grouped path tile heights to time")
    ap.add_argument("--gemm-heights", type=int, nargs="*", default=[64, 128],
                    help="the grouped GEMM alone at these tile heights (its MMAs' token side)")
    ap.add_argument("--linear-block-t", type=int, nargs="+", default=[32],
                    help="the FP8 projection kernel's token tiles to time (32: the default)")
    ap.add_argument("--profile", type=int, default=0, help="print the kernel table of one grouped MoE call of "
                    "this many tokens and exit")
    a = ap.parse_args()
    if a.profile:
        return profile_moe(a.profile)
    t0 = time.time()
    bw, peak = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s", flush=True)
    moe, alone = moe_rows(a.tokens, a.iters, peak, a.block_m, a.gemm_heights) if a.tokens else ([], [])
    lin = linear_rows(a.rows, a.iters, a.linear_block_t)
    failures = [f"MoE T={r['tokens']}: paths disagree (rel err {r['err']:.2e}) or non-finite"
                for r in moe if not (r["err"] < 2e-2 and r["finite"])]
    failures += [f"linear {r['name']} M={r['m']}: rel err {r['err']:.2e}" for r in lin if not r["err"] < 1e-2]
    tg = []
    if moe:  # issue 20's prefill-MoE target, at the largest token count run
        big = max(moe, key=lambda r: r["tokens"])
        best = max(big["stream_pct_peak"], big["grouped_pct_peak"])
        tg.append(dict(name=f"prefill MoE at {big['tokens']} tokens, % of the bf16 GEMM rate measured in the run",
                       measured=best, target=55.0, unit="%", met=best >= 55.0))
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak,
                host=platform.node(), cmd=" ".join(sys.argv), wall_s=time.time() - t0)
    with open(a.out, "w") as f:
        f.write(portable_json(dict(meta=meta, targets=on_card(tg, meta["gpu"]), moe=moe, expert_gemm=alone,
                                   linear=lin, failures=failures)))
    for msg in failures:
        print("FAILED:", msg)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
