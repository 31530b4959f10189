#!/usr/bin/env python3
"""TileLang SM90 kernels at DeepSeek-V4.1-Flash decode shapes: time, bytes/s, FLOP/s and the fraction of the
ceilings measured in the same run (device-to-device copy bandwidth, bf16 GEMM rate), next to the torch reference
op on the same GPU.

    python3 benchmarks/kernels_gpu.py [--out benchmarks/results/kernels_gpu.json] [--quick]

Bytes are the fewest a kernel must move (each input read once, each output written once), counted with the
per-weight sizes of ../shared/tools/roofline.py (FP4 = 0.5 + 1/32 B, FP8 = 1 + 1/1024 B per weight; window KV
528 B/token incl. scales, compressed KV 288 B/entry). Routed-expert bytes use the experts the benchmark's routing
actually touched (roofline.py's uniform-routing estimate is printed next to it). `ms` is the median of CUDA-event
timed replays of a CUDA graph holding several calls on distinct input sets (the GPU time a captured decode step
sees); `eager_ms` is the per-call time with Python dispatch. Inputs rotate so repeated calls do not hit in L2 (at
batch 1 the attention/indexer working sets are small enough to stay L2-resident anyway). Ceilings: a 4 GiB
device-to-device copy (bytes read + written) and an 8192^3 bf16 GEMM on random data, both in the same run.
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

from target_card import on_card  # benchmarks/, this script's folder

FP4_W, FP8_W = 0.5 + 1 / 32, 1 + 1 / 1024  # bytes per weight incl. scales (roofline.py)
_SINK = {}  # out path + metadata: every record rewrites the JSON, so a run cut at its time limit keeps its rows
E, TOPK, HID, INTER = 384, 6, 5120, 2304
HEADS, HDIM, WIN, ITOPK = 64, 512, 128, 512


def timeit(fn, iters=50, warmup=5):
    """Median ms of CUDA-event-timed calls of fn(i) (i rotates the input set)."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times)


def graph_time(fn, calls=8, iters=30):
    """Median ms per call of a CUDA graph holding `calls` calls fn(0..calls-1) (distinct input sets): the GPU
    time without Python/launch overhead, as a captured decode step would run. None if capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(calls):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        ms, mn = timeit(lambda i: graph.replay(), iters=iters, warmup=3)
        return ms / calls, mn / calls
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        print("graph capture failed:", type(exc).__name__, str(exc)[:200], flush=True)
        torch.cuda.synchronize()
        return None


def ceilings():
    n = 1 << 30  # 4 GiB of fp32
    src = torch.rand(n, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = timeit(lambda i: dst.copy_(src), iters=20)
    bw = 2 * src.numel() * 4 / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms, _ = timeit(lambda i: a @ b, iters=20)
    flops = 2 * 8192**3 / (ms * 1e-3)
    return bw, flops


def record(rows, name, shape, ms, ms_min, nbytes, flops, bw, peak, torch_ms=None, note="", eager_ms=None):
    """ms: the kernel's time (graph-replayed when available, else eager per-call); eager_ms: per-call time with
    Python dispatch, kept for reference."""
    r = dict(eager_ms=eager_ms, kernel=name, shape=shape, ms=ms, ms_min=ms_min, bytes=nbytes, flops=flops,
             bytes_per_s=nbytes / (ms * 1e-3), flop_per_s=flops / (ms * 1e-3),
             frac_bw=nbytes / (ms * 1e-3) / bw, frac_flops=flops / (ms * 1e-3) / peak,
             floor_ms=max(nbytes / bw, flops / peak) * 1e3, torch_ms=torch_ms,
             speedup=(torch_ms / ms) if torch_ms else None, note=note)
    r["frac_roofline"] = r["floor_ms"] / ms
    rows.append(r)
    _flush(rows)
    print(f"{name:18s} {shape:26s} {ms*1e3:9.1f} us  {r['bytes_per_s']/1e12:5.2f} TB/s ({r['frac_bw']*100:5.1f}% bw)"
          f"  {r['flop_per_s']/1e12:6.1f} TF/s ({r['frac_flops']*100:4.1f}%)  roofline {r['frac_roofline']*100:5.1f}%"
          + (f"  torch {torch_ms*1e3:9.1f} us  x{torch_ms/ms:6.1f}" if torch_ms else "")
          + (f"  [eager {eager_ms*1e3:.1f} us]" if eager_ms else ""), flush=True)


def targets(rows: list[dict]) -> list[dict]:
    """Issue 21's kernel targets this table measures: the decode attention kernel >= 50% of its roofline at B=64
    and 256 (one query a sequence, 32K), the MoE >= 85% of the copy bandwidth at B=1, 8 and 64 (measured None: the
    row did not run, e.g. under --only or --batches)."""
    def got(kernel, shape, key):
        r = next((r for r in rows if r.get("kernel") == kernel and r.get("shape") == shape and r.get(key)), None)
        return None if r is None else 100 * r[key]

    out = [(f"decode attention kernel at B={B}, 32K, % of its roofline", got("attn_decode",
            f"B={B} q/seq=1 ctx=32K", "frac_roofline"), 50.0) for B in (64, 256)]
    out += [(f"MoE decode at B={B}, % of copy bandwidth", got("moe_experts", f"B={B} fp4x384+fp8 shared",
             "frac_bw"), 85.0) for B in (1, 8, 64)]
    return [dict(name=n, measured=m, target=t, unit="%", met=m is not None and m >= t) for n, m, t in out]


def _flush(rows, sweeps=None):
    if not _SINK:
        return
    if sweeps is not None:
        _SINK["sweeps"] = sweeps
    meta = _SINK["meta"]
    with open(_SINK["path"], "w") as f:
        json.dump(dict(meta=meta, targets=on_card(targets(rows), meta["gpu"]), rows=rows,
                       moe_stage_sweep=_SINK.get("sweeps", [])), f, indent=1)


def measure(fn, calls=8, iters=30):
    """(ms, ms_min, eager_ms): graph-replayed time when capture works, else the eager time."""
    eager, eager_min = timeit(fn, iters=iters)
    g = graph_time(fn, calls=calls)
    return (g[0], g[1], eager) if g else (eager, eager_min, eager)


# ------------------------------------------------------------------------------------------------ MoE
def bench_moe(rows, bw, peak, batches, with_torch):
    from deepinfer.kernels.tilelang import moe as tl_moe
    from deepinfer.kernels.torch import moe as ref
    from deepinfer.kernels.torch import quant

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device=dev, generator=g)
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, device=dev, generator=g)
    routed = tl_moe.PackedExperts("fp4", u8(E, 2 * INTER, HID // 2), sc(E, 2 * INTER, HID // 32),
                                  u8(E, HID, INTER // 2), sc(E, HID, INTER // 32))
    e4m3 = lambda *s: (torch.randn(*s, device=dev, generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    shared = tl_moe.PackedExperts("fp8", e4m3(1, 2 * INTER, HID), sc(1, 2 * INTER // 32, HID // 32),
                                  e4m3(1, HID, INTER), sc(1, HID // 32, INTER // 32))
    gate_w = [(torch.randn(E, HID, device=dev, generator=g) * 0.02).bfloat16() for _ in range(16)]
    bias = torch.randn(E, device=dev, generator=g) * 0.05
    dense = shared_dense = None
    if with_torch:
        # the torch op's input: the same experts dequantised to bf16 (the half-interleaved w13 undone)
        def unil(w, half):
            R, C = w.shape
            t = w.view(R // (2 * half), 2, half, C)
            return t[:, 0].reshape(-1, C), t[:, 1].reshape(-1, C)
        dense = []
        for e in range(E):
            g1, u1 = unil(routed.w13[e], 32)
            gs, us = unil(routed.s13[e], 32)
            dense.append((quant.dequant_fp4_rows(g1, gs).bfloat16(), quant.dequant_fp4_rows(routed.w2[e], routed.s2[e]).bfloat16(),
                          quant.dequant_fp4_rows(u1, us).bfloat16()))
        g1, u1 = unil(shared.w13[0], 32)
        gs, us = unil(shared.s13[0], 1)
        shared_dense = (quant.dequant_fp8_blocks(g1.view(torch.float8_e4m3fn), gs).bfloat16(),
                        quant.dequant_fp8_blocks(shared.w2[0].view(torch.float8_e4m3fn), shared.s2[0]).bfloat16(),
                        quant.dequant_fp8_blocks(u1.view(torch.float8_e4m3fn), us).bfloat16())
    for B in batches:
        xs = [torch.randn(B, HID, device=dev, generator=g).bfloat16() for _ in range(8)]
        routes = []
        for i in range(8):
            w, idx = tl_moe.moe_router(xs[i], gate_w[i], bias, TOPK, "sqrtsoftplus", 1.0, True, 1.5)
            # uniform random experts (trained routers spread load; random gate weights here would not)
            idx = torch.rand(B, E, device=dev, generator=g).topk(TOPK, dim=-1).indices
            routes.append((w, idx))
        # router
        ms, mn, eg = measure(lambda i: tl_moe.moe_router(xs[i % 8], gate_w[i % 16], bias, TOPK, "sqrtsoftplus", 1.0,
                                                          True, 1.5))
        t_ms = timeit(lambda i: ref.moe_router(xs[i % 8], gate_w[i % 16], bias, TOPK, "sqrtsoftplus", 1.0, True, 1.5))[0]
        record(rows, "moe_router", f"B={B} E=384 D=5120", ms, mn, E * HID * 2 + B * HID * 2 + B * TOPK * 12,
               2 * B * E * HID, bw, peak, t_ms, eager_ms=eg)
        # experts (routed FP4 + shared FP8)
        touched = statistics.mean(len(torch.unique(r[1])) for r in routes)
        expect = E * (1 - (1 - TOPK / E) ** B)
        per_expert = 3 * HID * INTER * FP4_W
        nbytes = touched * per_expert + 3 * HID * INTER * FP8_W + B * HID * 2 * 2 + B * TOPK * 12
        flops = 2 * B * (TOPK + 1) * 3 * HID * INTER
        run = lambda i: tl_moe.moe_experts_packed(xs[i % 8], routes[i % 8][0], routes[i % 8][1], routed, shared, 10.0)
        ms, mn, eg = measure(run, calls=4)
        t_ms = None
        if with_torch:
            t_ms = timeit(lambda i: ref.moe_experts(xs[i % 8], routes[i % 8][0], routes[i % 8][1], dense,
                                                    shared_dense, 10.0), iters=5, warmup=1)[0]
        record(rows, "moe_experts", f"B={B} fp4x384+fp8 shared", ms, mn, nbytes, flops, bw, peak, t_ms,
               note=f"experts touched {touched:.1f} (uniform-routing estimate {expect:.1f})",
               eager_ms=eg)
    del routed, shared, dense


# ------------------------------------------------------------------------------------------------ attention
def attention_inputs(B, ctx, q_per_seq, g, dev="cuda", pool_rows=None):
    """Rotating input sets for the decode attention kernels: full FP8 window rings, one ratio-2 FP4 pool for all
    sequences (one entry per two tokens), 512 random selected rows per query; ~400 MB of sets in all. `pool_rows`:
    every query selects from the same first pool_rows rows instead (a prefill chunk's queries share one sequence's
    pool: 4,096 rows = 1.2 MB at 8K, L2-resident)."""
    n_q = B * q_per_seq
    pool = pool_rows or B * ctx // 2
    per_call = n_q * (WIN * 528 + ITOPK * 288) + n_q * HEADS * HDIM * 4
    sets = max(1, min(32, math.ceil(400e6 / per_call)))
    data = []
    for _ in range(sets):
        win_kv = (torch.randn(B, WIN, HDIM, device=dev, generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
        win_sc = torch.randint(118, 124, (B, WIN, HDIM // 32), dtype=torch.uint8, device=dev, generator=g)
        cmp_kv = torch.randint(0, 256, (pool, HDIM // 2), dtype=torch.uint8, device=dev, generator=g)
        cmp_sc = (torch.rand(pool, HDIM // 16, device=dev, generator=g) + 0.1).to(torch.float8_e4m3fn).view(torch.uint8)
        pos = ctx - q_per_seq
        win_pos = (pos - WIN + q_per_seq + torch.arange(WIN, device=dev)).int().repeat(B, 1)
        q_seq = torch.arange(B, device=dev).repeat_interleave(q_per_seq).int()
        q_pos = (pos + torch.arange(q_per_seq, device=dev)).repeat(B).int()
        per_seq = pool_rows or ctx // 2
        base = 0 if pool_rows else per_seq  # with pool_rows every query's rows are the shared pool's
        sel = torch.stack([torch.randperm(per_seq, device=dev, generator=g)[:ITOPK] + (i // q_per_seq) * base
                           for i in range(n_q)]).int()
        q = (torch.randn(n_q, HEADS, HDIM, device=dev, generator=g) * 0.3).bfloat16()
        data.append((q, q_seq, q_pos, win_kv, win_sc, win_pos, cmp_kv, cmp_sc, sel))
    return data


def bench_attention(rows, bw, peak, batches, contexts, with_torch, q_per_seq=1):
    from deepinfer.kernels.tilelang.attention import sink_attention_decode
    from deepinfer.kernels.torch import attention as ref

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    for ctx in contexts:
        for B in batches:
            n_q = B * q_per_seq
            data = attention_inputs(B, ctx, q_per_seq, g, dev)
            sets = len(data)
            sink = torch.randn(HEADS, device=dev, generator=g)
            scale = HDIM ** -0.5
            ms, mn, eg = measure(lambda i: sink_attention_decode(*data[i % sets], sink, scale))
            nbytes = B * (WIN * 528) + n_q * (ITOPK * 288 + ITOPK * 4 + HEADS * HDIM * 2 * 2)
            flops = 2 * 2 * n_q * HEADS * HDIM * (WIN + ITOPK)
            t_ms = None
            if with_torch:
                q = data[0][0]
                keys = (torch.randn(n_q, WIN + ITOPK, HDIM, device=dev, generator=g)).bfloat16()
                bias = torch.zeros(n_q, WIN + ITOPK, device=dev)
                t_ms = timeit(lambda i: ref.sink_attention(q, keys, bias, sink, scale), iters=20)[0]
            record(rows, "attn_decode", f"B={B} q/seq={q_per_seq} ctx={ctx // 1024}K", ms, mn, nbytes, flops, bw,
                   peak, t_ms, note="torch op times bf16 keys already gathered and dequantised" if with_torch else "",
                   eager_ms=eg)
            del data


# ------------------------------------------------------------------------------------------------ indexer
def bench_indexer(rows, bw, peak, batches, contexts, with_torch):
    from deepinfer.kernels.tilelang.indexer import indexer_scores_fp4
    from deepinfer.kernels.torch import indexer as ref

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(2)
    for ctx in contexts:
        G = ctx // 2  # ratio-2 index source
        for B in batches:
            sets = max(1, min(16, math.ceil(400e6 / (B * G * 68))))
            data = []
            for _ in range(sets):
                # the key pool, each sequence's entries in blocks of 16 contiguous rows (a cache block at ratio 4)
                k = torch.randint(0, 256, (B * G, 64), dtype=torch.uint8, device=dev, generator=g)
                ks = torch.randint(120, 128, (B * G, 4), dtype=torch.uint8, device=dev, generator=g)
                blocks = torch.randperm(B * G // 16, device=dev, generator=g).view(B, G // 16, 1)
                rows = (blocks * 16 + torch.arange(16, device=dev)).view(B, G)
                q = (torch.randn(B, 32, 128, device=dev, generator=g)).bfloat16()
                w = torch.randn(B, 32, device=dev, generator=g) * 32**-0.5
                data.append((q, torch.arange(B, dtype=torch.int32, device=dev),
                             torch.full((B,), G, dtype=torch.int32, device=dev), k, ks, rows, w))
            ms, mn, eg = measure(lambda i: indexer_scores_fp4(*data[i % sets], 128**-0.5))
            nbytes = B * G * (68 + 8) + B * 32 * 128 * 2 + B * G * 4  # keys + their int64 pool rows, q, scores
            flops = 2 * B * 32 * 128 * G
            t_ms = None
            if with_torch and B <= 64:
                kd = torch.randn(G, 128, device=dev, generator=g)
                q, w = data[0][0].float()[:1], data[0][6][:1]
                t1 = timeit(lambda i: ref.indexer_scores(q, kd, w, 128**-0.5), iters=10)[0]
                t_ms = t1 * B  # the torch op scores one sequence at a time
            record(rows, "indexer_scores", f"B={B} ctx={ctx // 1024}K G={G}", ms, mn, nbytes, flops, bw, peak, t_ms,
                   note="fp4 keys; torch = B x one-sequence fp32 op on dense keys", eager_ms=eg)
            del data


def _section(name):
    """Benchmarks of later kernels live in their own files next to this one (kernel_bench_*.py)."""
    import importlib

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return importlib.import_module(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/kernels_gpu.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--batches", help="comma-separated tokens / batch sizes (default 1,8,64,256; --quick: 1,64)")
    ap.add_argument("--only", default="moe,attn,indexer,mhc,topk")
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    try:
        batches = [int(b) for b in a.batches.split(",")] if a.batches else [1, 64] if a.quick else [1, 8, 64, 256]
    except ValueError:
        ap.error(f"--batches: comma-separated positive integers, got {a.batches!r}")
    if min(batches) < 1:
        ap.error(f"--batches: comma-separated positive integers, got {a.batches!r}")
    torch.manual_seed(0)
    bw, peak = ceilings()
    print(f"ceilings: copy {bw/1e12:.2f} TB/s, bf16 GEMM {peak/1e12:.0f} TFLOP/s", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak,
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), cmd=" ".join(sys.argv), host=platform.node())
    try:
        import tilelang
        meta["tilelang"] = tilelang.__version__
    except Exception:
        pass
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows, sweeps = [], []
    _SINK.update(path=a.out, meta=meta, sweeps=sweeps)
    sections = {
        "moe": lambda: bench_moe(rows, bw, peak, batches, not a.no_torch),
        "attn": lambda: (bench_attention(rows, bw, peak, batches, [4096, 32768], not a.no_torch),
                         bench_attention(rows, bw, peak, [64], [32768], False, q_per_seq=4)),
        "indexer": lambda: bench_indexer(rows, bw, peak, batches, [4096, 32768], not a.no_torch),
        "mhc": lambda: _section("kernel_bench_mhc").bench(record, measure, bw, peak, batches, not a.no_torch,
                                                          rows=rows),
        "topk": lambda: _section("kernel_bench_topk").bench(record, measure, bw, peak, batches, [4096, 32768],
                                                            not a.no_torch, rows=rows),
    }
    for name in a.only.split(","):
        try:
            sections[name]()
        except Exception as exc:  # noqa: BLE001 - one broken section must not lose the others' numbers
            import traceback
            traceback.print_exc()
            rows.append(dict(kernel=name, error=f"{type(exc).__name__}: {exc}"[:500]))
        torch.cuda.empty_cache()
    _flush(rows, sweeps)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
