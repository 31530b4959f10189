#!/usr/bin/env python3
"""Decode attention v1 (`attention.sink_attention_decode_v1`) vs v2 (`attention_kernel_v2.sink_attention_decode_v2`)
on one GPU at DeepSeek-V4.1 decode shapes: 64 heads x 512, window 128 (FP8 ring) + top-512 compressed (FP4 pool),
one query token per sequence at B = 1, 8, 64, 256 and 32K context, plus B=64 x 4 query tokens (MTP).

    python3 benchmarks/attn_v2_gpu.py --out $OUT/attn_v2.json [--sweep] [--batches 1,8,64,256] [--ctx 32768]

Inputs, bytes and FLOPs as benchmarks/kernels_gpu.py bench_attention (rotating input sets so the pool is not
L2-resident, bytes = the fewest the call must move, FLOPs = 2 * 2 * n_q * 64 * 512 * 640). Time = median of
CUDA-event-timed replays of a CUDA graph of 8 calls on distinct input sets. Ceilings measured in the same run:
device-to-device copy bandwidth and an 8192^3 bf16 GEMM; % roofline = max(bytes/bw, flops/peak) / time.
v2 first runs once in a child process with a time limit: a hang there (mbarrier protocol) is reported and the
v1 numbers still come back. --sweep also times v2 at other split counts (one compile each).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import attention_inputs as make_inputs  # noqa: E402  (the main table's inputs)
from kernels_gpu import ceilings, graph_time, timeit  # noqa: E402  (same timing and ceilings as the main table)

HEADS, HDIM, WIN, ITOPK = 64, 512, 128, 512
# predicted v2 % of roofline at 32K (written before any GPU run)
PREDICTED = {1: 2, 8: 11, 64: 45, 256: 55, "64x4": 55}


def smoke_v2(splits_list, limit_s):
    """Compile (into TileLang's disk cache) and run v2 once per split count in a child process. Returns None if
    fine, else a one-line reason."""
    code = textwrap.dedent(f"""
        import torch
        from deepinfer.kernels.tilelang.attention_kernel_v2 import sink_attention_decode_v2
        g = torch.Generator(device="cuda").manual_seed(0)
        n_q, P = 4, 2048
        for splits in {list(splits_list)!r}:
            out = sink_attention_decode_v2(
                torch.randn(n_q, 64, 512, device="cuda", generator=g).bfloat16(),
                torch.arange(n_q, dtype=torch.int32, device="cuda"),
                torch.full((n_q,), 200, dtype=torch.int32, device="cuda"),
                torch.randint(0, 120, (n_q, 128, 512), dtype=torch.uint8, device="cuda", generator=g),
                torch.full((n_q, 128, 16), 120, dtype=torch.uint8, device="cuda"),
                (73 + torch.arange(128, dtype=torch.int32, device="cuda")).repeat(n_q, 1),
                torch.randint(0, 256, (P, 256), dtype=torch.uint8, device="cuda", generator=g),
                torch.full((P, 32), 0x38, dtype=torch.uint8, device="cuda"),
                torch.randint(0, P, (n_q, 512), dtype=torch.int32, device="cuda", generator=g),
                torch.zeros(64, device="cuda"), 512 ** -0.5, splits=splits)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all(), splits
        print("ok")
    """)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return f"v2 did not finish within {limit_s} s (hang?)"
    if r.returncode != 0:
        return "v2 failed: " + (r.stdout + r.stderr).strip().splitlines()[-1][:300]
    return None


def measure(fn, calls=8, iters=30):
    eager, _ = timeit(fn, iters=iters)
    g = graph_time(fn, calls=calls, iters=iters)
    return (g[0] if g else eager), eager


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/attn_v2_gpu.json")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--no-mtp", action="store_true", help="skip the B=64 x 4 query tokens row")
    ap.add_argument("--sweep", action="store_true", help="also time v2 at other split counts")
    ap.add_argument("--hang-limit", type=int, default=240, help="seconds for v2's first compile + run (child)")
    a = ap.parse_args()

    from deepinfer.kernels.tilelang.attention import sink_attention_decode_v1 as sink_attention_decode
    from deepinfer.kernels.tilelang.attention_kernel_v2 import default_splits, sink_attention_decode_v2

    t0 = time.time()
    cases = [(int(b), 1) for b in a.batches.split(",")] + ([] if a.no_mtp else [(64, 4)])
    sweep = {}
    for B, qps in cases:
        n_q = B * qps
        cand = {default_splits(n_q)}
        if a.sweep:
            cand |= {s for s in (1, 2, 3, 5, 10) if s * n_q <= 4 * 132 and s != default_splits(n_q)}
        sweep[(B, qps)] = sorted(cand)
    all_splits = sorted({s for v in sweep.values() for s in v})
    v2_err = smoke_v2(all_splits, a.hang_limit)
    print(f"v2 smoke ({all_splits} splits): {v2_err or 'ok'}  [{time.time() - t0:.0f} s]", flush=True)

    torch.manual_seed(0)
    bw, peak = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak,
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), cmd=" ".join(sys.argv), host=platform.node(),
                v2_smoke=v2_err or "ok", predicted_v2_roofline_pct=PREDICTED)
    try:
        import tilelang
        meta["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001
        pass
    rows = []
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)

    def flush():
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    g = torch.Generator(device="cuda").manual_seed(1)
    sink = torch.randn(HEADS, device="cuda", generator=g)
    scale = HDIM ** -0.5
    hdr = (f"{'shape':>14} {'v1 us':>8} {'v2 us':>8} {'splits':>6} {'v2 TF/s':>8} {'v1 %roof':>8} {'v2 %roof':>8} "
           f"{'pred':>5} {'v2/v1':>6} {'rel err':>8}")
    print(hdr, flush=True)
    for B, qps in cases:
        n_q = B * qps
        data = make_inputs(B, a.ctx, qps, g)
        sets = len(data)
        nbytes = B * (WIN * 528) + n_q * (ITOPK * 288 + ITOPK * 4 + HEADS * HDIM * 2 * 2)
        flops = 2 * 2 * n_q * HEADS * HDIM * (WIN + ITOPK)
        floor_s = max(nbytes / bw, flops / peak)
        shape = f"B={B}" + (f"x{qps}" if qps > 1 else "")
        row = dict(B=B, q_per_seq=qps, n_q=n_q, ctx=a.ctx, bytes=nbytes, flops=flops, floor_us=floor_s * 1e6)
        v1_ms, v1_eager = measure(lambda i: sink_attention_decode(*data[i % sets], sink, scale))
        row.update(v1_us=v1_ms * 1e3, v1_eager_us=v1_eager * 1e3, v1_roofline=floor_s / (v1_ms * 1e-3))
        if v2_err is None:
            ref = sink_attention_decode(*data[0], sink, scale).float()
            runs = {}
            for s in sweep[(B, qps)]:
                ms, eager = measure(lambda i: sink_attention_decode_v2(*data[i % sets], sink, scale, splits=s))
                out = sink_attention_decode_v2(*data[0], sink, scale, splits=s).float()
                err = ((out - ref).norm() / ref.norm()).item()
                runs[s] = dict(us=ms * 1e3, eager_us=eager * 1e3, roofline=floor_s / (ms * 1e-3), rel_err_vs_v1=err)
            d = default_splits(n_q)
            row.update(v2_splits=d, v2_us=runs[d]["us"], v2_eager_us=runs[d]["eager_us"],
                       v2_roofline=runs[d]["roofline"], v2_rel_err_vs_v1=runs[d]["rel_err_vs_v1"],
                       v2_tflops=flops / (runs[d]["us"] * 1e-6) / 1e12, speedup=v1_ms * 1e3 / runs[d]["us"],
                       v2_by_splits={str(k): v for k, v in runs.items()})
        rows.append(row)
        flush()
        key = B if qps == 1 else f"{B}x{qps}"
        if "v2_us" in row:
            print(f"{shape:>14} {row['v1_us']:8.1f} {row['v2_us']:8.1f} {row['v2_splits']:6d} {row['v2_tflops']:8.1f} "
                  f"{row['v1_roofline'] * 100:7.1f}% {row['v2_roofline'] * 100:7.1f}% {PREDICTED.get(key, 0):4d}% "
                  f"{row['speedup']:5.2f}x {row['v2_rel_err_vs_v1']:8.1e}", flush=True)
            for s, r in sorted(row["v2_by_splits"].items(), key=lambda kv: int(kv[0])):
                if int(s) != row["v2_splits"]:
                    print(f"{'':>14} {'':>8} {r['us']:8.1f} {int(s):6d} {'':>8} {'':>8} {r['roofline'] * 100:7.1f}%"
                          f" {'':>5} {row['v1_us'] / r['us']:5.2f}x {r['rel_err_vs_v1']:8.1e}   (sweep)", flush=True)
        else:
            print(f"{shape:>14} {row['v1_us']:8.1f} {'-':>8} {'-':>6} {'-':>8} {row['v1_roofline'] * 100:7.1f}%",
                  flush=True)
        del data
        torch.cuda.empty_cache()
    print(f"wrote {a.out}  [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
