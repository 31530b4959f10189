#!/usr/bin/env python3
"""Decode attention (`attention.sink_attention_decode`: attention_decode_kernel over the FP8 window ring + FP4
compressed pool, as stored) vs the torch op, on one GPU at DeepSeek-V4.1 decode shapes: 64 heads x 512, window 128
+ top-512 compressed, one query token per sequence at B = 1, 8, 64, 256 and 32K context, plus B=64 x 4 query
tokens (MTP).

    source benchmarks/gpu_env.sh && python3 benchmarks/attention_decode_gpu.py --out $OUT/attention_decode.json \
        [--sweep] [--probes] [--batches 1,8,64,256] [--ctx 32768] [--pool-rows 4096]

Inputs, bytes and FLOPs as benchmarks/kernels_gpu.py bench_attention (rotating input sets so the pool is not
L2-resident, bytes = the fewest the call must move, FLOPs = 2 * 2 * n_q * 64 * 512 * 640). Time = median of
CUDA-event-timed replays of a CUDA graph of 8 calls on distinct input sets. Ceilings measured in the same run:
device-to-device copy bandwidth and an 8192^3 bf16 GEMM; % roofline = max(bytes/bw, flops/peak) / time.
torch = deepinfer.kernels.torch.attention.sink_attention on the same keys already dequantised and gathered into
per-query bf16 slates (what the model passes today; the gather itself is not timed); the kernel's output is checked
against it (relative error). The kernel first runs once in a child process with a time limit: a hang (mbarrier
protocol) is reported instead of stalling the run. Any row or split count that did not run is an error: the script
exits non-zero. --sweep also times other split counts (one compile each). --probes also times the kernel with one
part of its work dropped (attention_decode_kernel.PROBES: no loads, no dequantisation, no producer, no softmax, the
first one or two key blocks only, and one block without Q's loads and / or the output's stores; their outputs are
wrong and not checked), at the default split count: where the time of a key block goes, and the fixed part; and the
candidate settings (CANDIDATES: attention module constants; now WG1_ROWS = 12 and 20), their
outputs held to the default kernel's bits (a candidate that differs is a failure: the run exits
non-zero). The torch reference dequantises only the selected pool rows (B=2048 at 32K: ~20 GB of inputs and
reference, the one-split shapes of prefill; the whole pool asked 128 GiB). The previous kernel generation's numbers stay in
benchmarks/results/attn_v2_gpu_h200.json.
"""

import argparse
import contextlib
import os
import platform
import subprocess
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_gpu import portable_json  # noqa: E402
from kernels_gpu import attention_inputs as make_inputs  # noqa: E402  (the main table's inputs)
from kernels_gpu import ceilings, graph_time, timeit  # noqa: E402  (same timing and ceilings as the main table)
from target_card import on_card  # noqa: E402

HEADS, HDIM, WIN, ITOPK = 64, 512, 128, 512
# candidate settings of the kernel timed beside --probes, {name: {attention module constant: value}}; settled ones are
# removed with their losing code (git history): the twenty-third session's COMPACT, PREFETCH and STAGE_OUT; the
# thirty-seventh's POOL_DQ (16 codes a call won, the default) and ROW_TABLE ("wg1", WG1 building the row table: within
# noise). ("combine", CLUSTER_SPLITS = 0, was timed until the thirty-sixth session: attention_decode_gpu_s25_h100.log)
# "wg1rows12" / "wg1rows20": WG1 dequantises 12 / 20 rows of each key block while it waits for WG0's P (16, the
# default since the thirty-ninth session, beat 0, 8, 24 and 32)
CANDIDATES: dict[str, dict] = {"wg1rows12": {"WG1_ROWS": 12}, "wg1rows20": {"WG1_ROWS": 20}}
# predicted % of roofline at 32K (written before any GPU run of this kernel)
PREDICTED = {1: 2, 8: 11, 64: 45, 256: 55, "64x4": 55}


def targets(rows: list[dict]) -> list[dict]:
    """Issue 21's target for this kernel: >= 50% of its own roofline at B=64 and B=256, one query a sequence, 32K
    (measured None: that row did not run at 32K)."""
    out = []
    for B in (64, 256):
        r = next((r for r in rows if r["B"] == B and r["q_per_seq"] == 1 and r["ctx"] == 32768
                  and r.get("pool_rows") is None), None)  # a shared (L2-resident) pool's row is not the target's
        got = None if r is None else 100 * r["roofline"]
        out.append(dict(name=f"decode attention kernel at B={B}, 32K, % of its roofline", measured=got, target=50.0,
                        unit="%", met=got is not None and got >= 50.0))
    return out


def kernel_specs(splits_list, probes=(), cands=False) -> list[tuple]:
    """jit's arguments for the decode kernel at each split count: as is, with each probe, with each candidate
    setting (attention.decode_spec, what the launcher passes), for the parallel precompile."""
    from deepinfer.kernels.tilelang import attention

    specs = [attention.decode_spec(WIN, ITOPK, s, WIN, pr) for s in splits_list for pr in ("", *probes)]
    for knobs in CANDIDATES.values() if cands else ():
        with mock.patch.multiple(attention, **knobs):
            specs += [attention.decode_spec(WIN, ITOPK, s, WIN) for s in splits_list]
    return specs


def smoke(splits_list, probes=(), cands=False):
    """One small call per split count, and per probe at the first split count; with the candidates, each at every
    split count and at one split with 300 queries (run in the child process by --smoke)."""
    from deepinfer.kernels.tilelang import attention

    calls = [(s, "", 4, {}) for s in splits_list] + [(splits_list[0], p, 4, {}) for p in probes]
    for knobs in CANDIDATES.values() if cands else ():
        calls += [(s, "", 4, knobs) for s in splits_list] + [(1, "", 300, knobs)]
    for splits, probe, n_q, knobs in calls:
        with mock.patch.multiple(attention, **knobs) if knobs else contextlib.nullcontext():
            out = _smoke_call(attention.sink_attention_decode_kernel, n_q, splits, probe)
        assert probe or torch.isfinite(out).all(), (splits, knobs)
    print("ok")


def _smoke_call(kernel, n_q, splits, probe):
    """The kernel once on random caches: n_q queries, a sequence each."""
    g = torch.Generator(device="cuda").manual_seed(0)
    P = 2048
    out = kernel(
        torch.randn(n_q, 64, 512, device="cuda", generator=g).bfloat16(),
        torch.arange(n_q, dtype=torch.int32, device="cuda"),
        torch.full((n_q,), 200, dtype=torch.int32, device="cuda"),
        torch.randint(0, 120, (n_q, 128, 512), dtype=torch.uint8, device="cuda", generator=g),
        torch.full((n_q, 128, 16), 120, dtype=torch.uint8, device="cuda"),
        (73 + torch.arange(128, dtype=torch.int32, device="cuda")).repeat(n_q, 1),
        torch.randint(0, 256, (P, 256), dtype=torch.uint8, device="cuda", generator=g),
        torch.full((P, 32), 0x38, dtype=torch.uint8, device="cuda"),
        torch.randint(0, P, (n_q, 512), dtype=torch.int32, device="cuda", generator=g),
        torch.zeros(64, device="cuda"), 512 ** -0.5, splits=splits, probe=probe)
    torch.cuda.synchronize()
    return out


def smoke_in_child(splits_list, limit_s, probes=(), cands=False):
    """Compile (into the JIT disk cache) and run the kernel once per split count in a child process: this script
    again (so sys.path[0] is benchmarks/, never the repo root whose deepinfer/ lacks kernels/). None if fine,
    else a one-line reason."""
    cmd = [sys.executable, os.path.abspath(__file__), "--smoke", ",".join(map(str, splits_list)) + ";"
           + ",".join(probes) + ";" + ("1" if cands else "")]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return f"the decode kernel did not finish within {limit_s} s (hang?)"
    if r.returncode != 0:
        return "the decode kernel failed: " + ((r.stdout + r.stderr).strip().splitlines() or ["?"])[-1][:300]
    return None


def torch_slates(data, dev="cuda"):
    """The torch op's operands for one input set: per-query bf16 key slates [window ∥ selected] and their bias."""
    from deepinfer.kernels.torch import quant

    q, q_seq, q_pos, win_kv, win_sc, win_pos, cmp_kv, cmp_sc, sel = data
    B = win_kv.shape[0]
    win = (win_kv.view(torch.float8_e4m3fn).float().view(B, WIN, HDIM // 32, 32)
           * quant.e8m0_to_float(win_sc)[..., None]).view(B, WIN, HDIM)
    # only the selected pool rows are dequantised: the whole ratio-2 pool is B x ctx / 2 rows (fp32: 128 GiB at
    # B=2048, 32K, an out-of-memory failure of the H200 run)
    rows = sel.clamp_min(0).long()
    kv, sc = cmp_kv[rows], cmp_sc[rows]
    codes = torch.stack([kv & 15, kv >> 4], dim=-1).flatten(-2)
    picked = quant.e2m1_values(codes) * sc.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1)
    seq = q_seq.long()
    keys = torch.cat([win[seq].bfloat16(), picked.bfloat16()], 1)
    wp, p = win_pos[seq], q_pos[:, None]
    vis = torch.cat([(wp >= 0) & (wp <= p) & (wp > p - WIN), sel >= 0], 1)
    return q, keys, torch.where(vis, 0.0, float("-inf")).to(dev)


def measure(fn, calls=8, iters=30):
    eager, _ = timeit(fn, iters=iters)
    g = graph_time(fn, calls=calls, iters=iters)
    return (g[0] if g else eager), eager


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/attention_decode_gpu.json")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--no-mtp", action="store_true", help="skip the B=64 x 4 query tokens row")
    ap.add_argument("--sweep", action="store_true", help="also time other split counts")
    ap.add_argument("--probes", action="store_true", help="also time the kernel's probes (parts of it dropped) and "
                    "the candidates")
    ap.add_argument("--probe-names", default=None,
                    help="with --probes: which probes (comma-separated; default all; '' for the candidates alone)")
    ap.add_argument("--pool-rows", type=int, default=None,
                    help="every query selects from one shared pool of this many rows (the prefill's: 4096 at 8K, "
                         "L2-resident) instead of its own sequence's ctx/2 (default)")
    ap.add_argument("--hang-limit", type=int, default=240, help="seconds for the first compile + run (child)")
    ap.add_argument("--smoke", help=argparse.SUPPRESS)  # child mode: comma-separated split counts
    a = ap.parse_args()
    if a.pool_rows is not None and a.pool_rows < ITOPK:
        ap.error(f"--pool-rows must be at least {ITOPK} (the rows a query selects); got {a.pool_rows}")
    if a.smoke:
        splits_arg, probes_arg, cands_arg = a.smoke.split(";")
        return smoke([int(s) for s in splits_arg.split(",")], [p for p in probes_arg.split(",") if p],
                     cands_arg == "1")

    from deepinfer.kernels.tilelang._build import jit_stats, sm_count
    from deepinfer.kernels.tilelang.attention import default_splits, sink_attention_decode, \
        sink_attention_decode_kernel
    from deepinfer.kernels.tilelang import attention
    from deepinfer.kernels.tilelang.attention_decode_kernel import PROBES
    from deepinfer.kernels.torch import attention as ref

    t0 = time.time()
    sms = sm_count()
    n_blocks = (WIN + ITOPK) // 64
    cases = [(int(b), 1) for b in a.batches.split(",")] + ([] if a.no_mtp else [(64, 4)])
    sweep = {}
    for B, qps in cases:
        d = default_splits(B * qps, n_blocks, sms)
        cand = {d}
        if a.sweep:
            cand |= {s for s in (1, 2, 3, 5, 10) if s * B * qps <= 4 * sms}
        sweep[(B, qps)] = sorted(cand)
    all_splits = sorted({s for v in sweep.values() for s in v})
    names = ",".join(PROBES) if a.probe_names is None else a.probe_names
    probes = [p for p in names.split(",") if p] if a.probes else []
    bad = sorted(set(probes) - set(PROBES))
    if bad:
        raise SystemExit(f"attention_decode_gpu: --probe-names: unknown {bad}; allowed: {[p for p in PROBES if p]}")
    if a.probes:  # every probe and candidate at every default split count, compiled in parallel first
        from deepinfer.kernels.tilelang._build import precompile

        specs = kernel_specs(all_splits, probes, cands=True)
        precompile(specs)
        print(f"compiled {len(specs)} decode kernels  [{time.time() - t0:.0f} s]", flush=True)
    err = smoke_in_child(all_splits, a.hang_limit, probes, cands=a.probes)
    print(f"decode smoke ({all_splits} splits): {err or 'ok'}  [{time.time() - t0:.0f} s]", flush=True)
    if err:
        raise SystemExit(f"attention_decode_gpu: {err}; nothing measured")

    torch.manual_seed(0)
    bw, peak = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s, {sms} SMs", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak, sms=sms,
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), cmd=" ".join(sys.argv), host=platform.node(),
                predicted_roofline_pct=PREDICTED, pool_rows=a.pool_rows)
    try:
        import tilelang
        meta["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001
        pass
    rows, missing = [], []
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)

    def flush():
        with open(a.out, "w") as f:
            f.write(portable_json(dict(meta=meta, targets=on_card(targets(rows), meta["gpu"]), rows=rows,
                                       missing=missing, jit=jit_stats())))

    g = torch.Generator(device="cuda").manual_seed(1)
    sink = torch.randn(HEADS, device="cuda", generator=g)
    scale = HDIM ** -0.5
    print(f"{'shape':>14} {'us':>8} {'splits':>6} {'TF/s':>6} {'%roof':>6} {'pred':>5} {'torch us':>9} "
          f"{'speedup':>8} {'rel err':>8}", flush=True)
    for B, qps in cases:
        n_q = B * qps
        shape = f"B={B}" + (f"x{qps}" if qps > 1 else "")
        try:
            data = make_inputs(B, a.ctx, qps, g, pool_rows=a.pool_rows)
            sets = len(data)
            nbytes = B * (WIN * 528) + n_q * (ITOPK * 288 + ITOPK * 4 + HEADS * HDIM * 2 * 2)
            flops = 2 * 2 * n_q * HEADS * HDIM * (WIN + ITOPK)
            floor_s = max(nbytes / bw, flops / peak)
            q, keys, bias = torch_slates(data[0])
            expect = ref.sink_attention(q, keys, bias, sink, scale).float()
            t_ms = timeit(lambda i: ref.sink_attention(q, keys, bias, sink, scale), iters=10, warmup=2)[0]
            del keys, bias
            runs = {}
            for s in sweep[(B, qps)]:
                ms, eager = measure(lambda i: sink_attention_decode(*data[i % sets], sink, scale, splits=s))
                out = sink_attention_decode(*data[0], sink, scale, splits=s).float()
                rel = ((out - expect).norm() / expect.norm()).item()
                runs[s] = dict(us=ms * 1e3, eager_us=eager * 1e3, roofline=floor_s / (ms * 1e-3), rel_err_vs_torch=rel)
            d = default_splits(n_q, n_blocks, sms)
            probe_us = {}
            for pr in probes:  # the same call with one part of the work dropped (output not checked)
                probe_us[pr] = measure(lambda i: sink_attention_decode_kernel(*data[i % sets], sink, scale, splits=d,
                                                                              probe=pr))[0] * 1e3
            base = sink_attention_decode_kernel(*data[0], sink, scale, splits=d) if a.probes else None
            for name, knobs in CANDIDATES.items() if a.probes else ():  # real variants: their outputs checked
                with mock.patch.multiple(attention, **knobs):
                    probe_us[name] = measure(lambda i: sink_attention_decode_kernel(*data[i % sets], sink, scale,
                                                                                    splits=d))[0] * 1e3
                    cand = sink_attention_decode_kernel(*data[0], sink, scale, splits=d)
                probe_us[f"{name}_rel_err"] = ((cand.float() - expect).norm() / expect.norm()).item()
                if not torch.equal(cand.view(torch.int16), base.view(torch.int16)):  # a candidate changes no bit
                    missing.append(dict(shape=f"{shape} {name}", error="candidate output differs from the default "
                                        f"kernel's bits (rel err vs torch {probe_us[f'{name}_rel_err']:.1e})"))
                    print(f"{shape:>14} {name}: {missing[-1]['error']}", flush=True)
            row = dict(B=B, q_per_seq=qps, n_q=n_q, ctx=a.ctx, pool_rows=a.pool_rows,
                       bytes=nbytes, flops=flops, floor_us=floor_s * 1e6,
                       splits=d, us=runs[d]["us"], eager_us=runs[d]["eager_us"], roofline=runs[d]["roofline"],
                       tflops=flops / (runs[d]["us"] * 1e-6) / 1e12, rel_err_vs_torch=runs[d]["rel_err_vs_torch"],
                       torch_us=t_ms * 1e3, speedup=t_ms * 1e3 / runs[d]["us"],
                       by_splits={str(k): v for k, v in runs.items()}, probes_us=probe_us)
        except Exception as exc:  # noqa: BLE001 - record it, finish the other rows, fail at the end
            missing.append(dict(shape=shape, error=f"{type(exc).__name__}: {exc}"[:500]))
            print(f"{shape:>14} FAILED: {missing[-1]['error']}", flush=True)
            flush()
            continue
        rows.append(row)
        flush()
        key = B if qps == 1 else f"{B}x{qps}"
        print(f"{shape:>14} {row['us']:8.1f} {d:6d} {row['tflops']:6.1f} {row['roofline'] * 100:5.1f}% "
              f"{PREDICTED.get(key, 0):4d}% {row['torch_us']:9.1f} {row['speedup']:7.1f}x "
              f"{row['rel_err_vs_torch']:8.1e}", flush=True)
        if probe_us:
            print(f"{'':>14} probes (us): " + ", ".join(f"{k} {v:.3g}" for k, v in probe_us.items()), flush=True)
        for s, r in sorted(runs.items()):
            if s != d:
                print(f"{'':>14} {r['us']:8.1f} {s:6d} {'':>6} {r['roofline'] * 100:5.1f}% {'':>5} {'':>9} "
                      f"{t_ms * 1e3 / r['us']:7.1f}x {r['rel_err_vs_torch']:8.1e}   (sweep)", flush=True)
        del data
        torch.cuda.empty_cache()
    print(f"wrote {a.out}  [{time.time() - t0:.0f} s]", flush=True)
    if missing:
        raise SystemExit(f"attention_decode_gpu: {len(missing)} failures (rows that did not run, candidates whose "
                         "bits differ): " + "; ".join(m["shape"] for m in missing))


if __name__ == "__main__":
    main()
