#!/usr/bin/env python3
"""FP8 projections at DeepSeek-V4.1-Flash decode shapes: the tilelang-sm90 `linear` (kernels/tilelang/linear.py,
weight-only FP8 GEMM, FP8 weights read as stored) vs torch's bf16 linear (cuBLAS) on the dequantised weight, which
is what the model ran before.

    source benchmarks/gpu_env.sh && python3 benchmarks/linear_gpu.py --out $OUT/linear_gpu.json \
        [--batches 1,8,64,256] [--only wq_a,wkv] [--sweep]

Time = median per call of CUDA-event-timed replays of a CUDA graph holding `calls` calls on distinct weight copies
(kernels_gpu.graph_time), with enough copies that they do not fit the 50 MB L2 together, so every call reads its
weights from HBM as a decode step does; eager = per-call time with Python dispatch (kernels_gpu.timeit). Bytes =
the fewest the call must move: weights (FP8 1 + 1/1024 B per weight incl. scales; bf16 2 B for torch) +
activations in + outputs out. % bw = bytes / time / the device-to-device copy bandwidth measured in the same run;
% roofline = max(bytes / bw, FLOPs / bf16 GEMM rate) / time. Self-check per row: the kernel against torch on the
dequantised weight (relative error < 1e-2) and the kernel path really taken (linear.why_not is None); a failed
check exits non-zero. `--sweep` also times every K split count at M=1 (the shipped policy: split_count);
`--tiles` times the GEMM at other tiles (tokens x weight rows per block; the policy: linear.gemm_tiles).
Up to GEMV_ROWS rows `linear` takes the GEMV (gemv_kernel.py; column `path`); `gemv us` and `gemm us` time both
kernels on the same call wherever the GEMV can run (up to its M_MAX rows), so GEMV_ROWS is chosen from one run.
"""

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import ceilings, graph_time  # noqa: E402  (one timing method for every GPU benchmark)
from kernels_gpu import timeit  # noqa: E402

FP8_W = 1 + 1 / 1024
SHAPES = {  # name: (N, K) of one ops.linear call in a V4.1-Flash layer
    "wq_a": (1280, 5120),
    "wq_b": (32768, 1280),
    "wkv": (512, 5120),
    "wo_a_group": (1024, 4096),  # one of the 8 per-group calls
    "wo_b": (5120, 8192),
    "indexer_wq_b": (4096, 1280),
    "shared_w1": (2304, 5120),
    "shared_w2": (5120, 2304),
}
L2_SPREAD = 160e6  # bytes of distinct weights per graph: > 3x the H200's L2


def _weights(n, k, copies, gen):
    from deepinfer.kernels.fp8_weight import Fp8BlockWeight
    from deepinfer.kernels.torch import quant

    out = []
    for _ in range(copies):
        w = torch.randn(n, k, generator=gen, device="cuda") * 0.02
        blocks = w.view(n // 32, 32, k // 32, 32)
        s = quant.ceil_pow2(blocks.abs().amax(dim=(1, 3)).clamp_min(1e-8) / quant.FP8_MAX)
        codes = (blocks / s[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
        q = Fp8BlockWeight(codes.view(torch.uint8), (torch.log2(s).round() + 127).to(torch.uint8))
        out.append((q, q.dense(torch.bfloat16)))
        del w, blocks
    return out


def _time(fn, calls):
    g = graph_time(fn, calls=calls)
    eager, _ = timeit(fn, iters=30)
    return (g[0] if g else eager), eager


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--only", default="")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tiles", default="", help="GEMM tiles to time beside the policy's, TxN,... (e.g. 32x64,64x128): "
                                                "each must give the policy's bits (a difference exits non-zero)")
    args = ap.parse_args()
    from deepinfer.kernels.tilelang import linear as launcher
    from deepinfer.kernels.tilelang.gemv_kernel import M_MAX
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_K

    batches = [int(b) for b in args.batches.split(",")]
    names = [n for n in SHAPES if not args.only or n in args.only.split(",")]
    bw, peak = ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node(), copy_bw=bw,
                gemm_flops=peak)
    rows, sweep, failed = [], [], []

    def flush():
        if args.out:
            with open(args.out, "w") as f:
                # no issue names a target for one projection alone: the step's roofline is decode_gpu.py's
                json.dump(dict(meta=meta, targets=[], rows=rows, sweep=sweep), f, indent=1)

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':13s} {'N x K':>12s} {'M':>5s} {'path':>4s} {'splits':>6s} {'fp8 us':>8s} {'% bw':>6s} "
          f"{'% roof':>6s} {'gemv us':>8s} {'gemm us':>8s} {'bf16 us':>8s} {'% bw':>6s} {'x':>5s} {'eager us':>9s} "
          f"{'rel err':>8s}", flush=True)
    for name in names:
        n, k = SHAPES[name]
        calls = max(8, min(64, int(L2_SPREAD // (n * k))))
        sets = _weights(n, k, calls, gen)
        for m in batches:
            xs = [torch.randn(m, k, generator=gen, device="cuda").bfloat16() for _ in range(calls)]
            q0, d0 = sets[0]
            reason = launcher.why_not(xs[0], q0)
            if reason is not None:
                failed.append(f"{name} M={m}: kernel path not taken ({reason})")
                continue
            out = launcher.linear(xs[0], q0)
            ref = torch.nn.functional.linear(xs[0], d0)
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            if not err < 1e-2:
                failed.append(f"{name} M={m}: rel err {err:.2e}")
            gemv = launcher._gemv_ok(m, q0)
            fp8_ms, eager_ms = _time(lambda i: launcher.linear(xs[i % calls], sets[i % calls][0]), calls)
            gemm_ms = _time(lambda i: launcher.fp8_linear(xs[i % calls], sets[i % calls][0]), calls)[0]
            gemv_us = None  # where the GEMV can run (up to M_MAX rows), timed whatever the policy takes
            if m <= M_MAX[-1] and launcher.gemv_fits(q0):
                gemv_us = _time(lambda i: launcher.fp8_gemv(xs[i % calls], sets[i % calls][0]), calls)[0] * 1e3
            tile_us = {}
            for tile in [t for t in args.tiles.split(",") if t]:
                bt, bn = (int(v) for v in tile.split("x"))
                if n % bn:
                    continue
                if not torch.equal(launcher.fp8_linear(xs[0], q0, block_t=bt, block_n=bn),
                                   launcher.fp8_linear(xs[0], q0)):
                    failed.append(f"{name} M={m}: tile {tile} changes the bits")
                tile_us[tile] = _time(lambda i: launcher.fp8_linear(xs[i % calls], sets[i % calls][0], block_t=bt,
                                                                    block_n=bn), calls)[0] * 1e3
            bf16_ms, _ = _time(lambda i: torch.nn.functional.linear(xs[i % calls], sets[i % calls][1]), calls)
            act = m * k * 2 + m * n * 2
            fp8_bytes, bf16_bytes, flops = n * k * FP8_W + act, n * k * 2 + act, 2 * m * n * k
            splits = launcher.gemv_splits(n, k) if gemv else launcher.split_count(n, k)
            r = dict(shape=name, n=n, k=k, m=m, path="gemv" if gemv else "gemm", splits=splits, fp8_us=fp8_ms * 1e3,
                     gemm_us=gemm_ms * 1e3, gemv_us=gemv_us,
                     fp8_eager_us=eager_ms * 1e3, fp8_frac_bw=fp8_bytes / (fp8_ms * 1e-3) / bw,
                     fp8_frac_roofline=max(fp8_bytes / bw, flops / peak) / (fp8_ms * 1e-3),
                     bf16_us=bf16_ms * 1e3, bf16_frac_bw=bf16_bytes / (bf16_ms * 1e-3) / bw,
                     speedup=bf16_ms / fp8_ms, rel_err=err, tiles=list(launcher.gemm_tiles(m, n)), tile_us=tile_us)
            rows.append(r)
            flush()
            print(f"{name:13s} {f'{n}x{k}':>12s} {m:5d} {r['path']:>4s} {r['splits']:6d} {r['fp8_us']:8.1f} "
                  f"{r['fp8_frac_bw']*100:6.1f} {r['fp8_frac_roofline']*100:6.1f} "
                  f"{'-' if gemv_us is None else f'{gemv_us:.1f}':>8s} {r['gemm_us']:8.1f} "
                  f"{r['bf16_us']:8.1f} {r['bf16_frac_bw']*100:6.1f}"
                  f" {r['speedup']:5.2f} {r['fp8_eager_us']:9.1f} {err:8.1e}"
                  + "".join(f"  {t}: {us:.1f}" for t, us in tile_us.items()), flush=True)
        if args.sweep:
            x = [torch.randn(1, k, generator=gen, device="cuda").bfloat16() for _ in range(calls)]
            steps = k // BLOCK_K
            for s in [d for d in range(1, min(steps, 64) + 1) if steps % d == 0]:
                ms, _ = _time(lambda i: launcher.fp8_linear(x[i % calls], sets[i % calls][0], k_splits=s), calls)
                frac = (n * k * FP8_W) / (ms * 1e-3) / bw
                sweep.append(dict(shape=name, m=1, splits=s, us=ms * 1e3, frac_bw=frac))
                flush()
                print(f"  sweep {name} M=1 splits={s:3d}: {ms * 1e3:7.1f} us  {frac * 100:5.1f}% bw", flush=True)
        del sets
        torch.cuda.empty_cache()
    for f in failed:
        print("FAILED:", f, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
