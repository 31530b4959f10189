#!/usr/bin/env python3
"""MoE experts at DeepSeek-V4.1-Flash decode shapes: `moe.moe_experts_packed` (moe_kernel's grouped GEMMs, routing
table, shared expert on a side stream) vs the torch op, 384 FP4 routed experts + one FP8 shared expert, hidden
5120, inter 2304, top-6, uniform random routing.

    source benchmarks/gpu_env.sh && python3 benchmarks/moe_gpu.py --out $OUT/moe.json \
        [--batches 1,8,64,256] [--sweep] [--probes]

Time = median per call of CUDA-event-timed replays of a CUDA graph holding 4 calls on distinct input sets (the GPU
time a captured decode step sees). Bytes = the fewest the call must move: the experts its routing touched (FP4 0.5
+ 1/32 B per weight incl. scales) + the shared expert (FP8 1 + 1/1024 B) + activations; % bw = bytes / time / the
device-to-device copy bandwidth measured in the same run. torch = deepinfer.kernels.torch.moe.moe_experts on the
same PackedExperts (it dequantises the experts a call touches), eager. Self-check: the kernel's output against the
torch op's (relative error, must stay < 1e-2; both follow the same bf16 rounding points); a failed check or a
variant that did not run exits non-zero. A per-kernel breakdown follows the table (routed up/down, shared up/down,
each alone, a pass that does not run failing the run; --probes adds the grouped GEMM's routed passes with their
FP4 decode, their MMAs or both left out, at every batch). The JSON is
rewritten after every row. All kernels are compiled first, in parallel. The previous
kernel generation's numbers stay in benchmarks/results/moe_v3_gpu_h200.json.
"""

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import graph_time  # noqa: E402  (one timing method for every GPU benchmark)
from kernels_gpu import timeit as _timeit  # noqa: E402
from target_card import on_card  # noqa: E402
from decode_gpu import portable_json  # noqa: E402

E, TOPK, HID, INTER = 384, 6, 5120, 2304
FP4_W, FP8_W = 0.5 + 1 / 32, 1 + 1 / 1024
LIMIT = 10.0
SETS = 8
TARGET_BATCHES = (1, 8, 64)


def timeit(fn, iters=20, warmup=3):
    """Median ms of CUDA-event-timed calls (kernels_gpu.timeit)."""
    return _timeit(fn, iters=iters, warmup=warmup)[0]


def graph_ms(fn, calls=4, iters=20):
    """Median ms per call of a CUDA graph of fn(0..calls-1); None if capture fails (kernels_gpu.graph_time)."""
    g = graph_time(fn, calls=calls, iters=iters)
    return g[0] if g else None


def copy_bandwidth():
    src = torch.rand(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = timeit(lambda i: dst.copy_(src), iters=20)
    return 2 * (1 << 29) * 4 / (ms * 1e-3)


def make_experts(dev, g):
    from deepinfer.kernels.packed_experts import PackedExperts

    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, device=dev, generator=g)
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, device=dev, generator=g)
    routed = PackedExperts("fp4", u8(E, 2 * INTER, HID // 2), sc(E, 2 * INTER, HID // 32), u8(E, HID, INTER // 2),
                           sc(E, HID, INTER // 32))
    e4m3 = lambda *s: (torch.randn(*s, device=dev, generator=g) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
    shared = PackedExperts("fp8", e4m3(1, 2 * INTER, HID), sc(1, 2 * INTER // 32, HID // 32), e4m3(1, HID, INTER),
                           sc(1, HID // 32, INTER // 32))
    return routed, shared


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="moe_gpu.json")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--sweep", action="store_true", help="also time tile variants (stages, token tile, split K)")
    ap.add_argument("--probes", action="store_true",
                    help="also time the routed passes alone with the FP4 decode, the MMAs or both left out "
                         "(moe_kernel.PROBES; wrong results, timing only)")
    ap.add_argument("--variants", default="",
                    help="comma-separated sweep variant names to time (implies --sweep; the others are not compiled)")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="expert popularity ~ rank^-skew (0: uniform); a token's experts are drawn without "
                         "replacement by that popularity (Gumbel top-k), as a router whose load is not balanced")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    t_start = time.time()

    from deepinfer.kernels.packed_experts import PackedExperts
    from deepinfer.kernels.tilelang import moe, moe_kernel
    from deepinfer.kernels.tilelang._build import jit, jit_stats
    from deepinfer.kernels.torch import moe as torch_moe

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    routed, shared = make_experts(dev, g)
    # the shared expert (35 MB) fits L2 when its kernels are timed alone: rotate copies for the breakdown
    shared_copies = [shared] + [
        PackedExperts("fp8", *(t.clone() for t in (shared.w13, shared.s13, shared.w2, shared.s2))) for _ in range(3)]

    # ---- compile everything first, in parallel
    # sweep variants (each a patch of moe.py's tile policy): is deeper pipelining worth the occupancy (the weight
    # threads keep S-3 stages in flight across each barrier; 128-K steps keep 5 of 8 in the same shared memory as
    # 1 of 4 256-K steps), are larger FP4 steps, a wider token tile, or smaller
    # shared-expert steps / a split shared down pass better? Does moe_prep still beat torch's sorts (moe_table.py)
    # at the largest sizes it builds?
    variants = {"kernel": {}}
    if args.sweep or args.variants:
        variants.update({"fp4 stages5": {"fp4": (256, 5)}, "fp4 bk512": {"fp4": (512, 4)},
                         "fp4 bk128 stages8": {"fp4": (128, 8)}, "fp4 bk128 stages6": {"fp4": (128, 6)},
                         "fp8 bk256 stages8": {"fp8": (256, 8)}, "fp8 bk128 stages16": {"fp8": (128, 16)},
                         "routed bn64": {"routed_bn": 64}, "routed bt8 bn128": {"routed_bt": 8, "routed_bn": 128},
                         "routed bt16 bn64": {"routed_bt": 16, "routed_bn": 64},
                         "routed bt16 bn128": {"routed_bt": 16, "routed_bn": 128},
                         "routed bt32 bn128": {"routed_bt": 32, "routed_bn": 128}, "fp8 bk256": {"fp8": (256, 4)},
                         "shared-down split3": {"shared_down_splits": 3},
                         "routed-down split3": {"routed_down_splits": 3},
                         "table by torch sorts": {"prep_assignments": 0},
                         "shared dense": {"shared_dense_tokens": 1},
                         "shared streamed": {"shared_dense_tokens": 1 << 30},
                         "bulk": {"bulk_tokens": 1 << 30, "warp_stream": 0}, "warp off": {"warp_stream": 0}})
    if args.variants:
        wanted = [v.strip() for v in args.variants.split(",")]
        unknown = [v for v in wanted if v not in variants]
        if unknown:
            ap.error(f"--variants: unknown {unknown}; allowed: {sorted(variants)}")
        variants = {k: v for k, v in variants.items() if k == "kernel" or k in wanted}

    # the tile-policy functions of moe.py a variant key replaces, each by a constant choice
    policy = {"routed_bt": "routed_block_t", "routed_bn": "routed_block_n", "routed_down_splits": "routed_down_splits"}

    @contextlib.contextmanager
    def with_variant(var):
        """Patch moe.py's tile policy for one sweep variant."""
        base = moe.pass_config
        with contextlib.ExitStack() as stack:
            if "fp4" in var or "fp8" in var:
                stack.enter_context(mock.patch.object(moe, "pass_config", lambda fmt, k, bt, bn=64: var[fmt] if (
                    fmt in var and k % var[fmt][0] == 0 and moe_kernel.shared_bytes(fmt, bt, *var[fmt], bn)
                    <= 227 * 1024) else base(fmt, k, bt, bn)))  # a tile the shared memory cannot hold: the policy
            for key, name in policy.items():
                if key in var:
                    stack.enter_context(mock.patch.object(moe, name, lambda *_, v=var[key]: v))
            if "prep_assignments" in var:  # the routing table's crossover from moe_prep to torch's sorts
                stack.enter_context(mock.patch.object(moe, "PREP_KERNEL_ASSIGNMENTS", var["prep_assignments"]))
            if "bulk_tokens" in var:  # the routed passes through moe_bulk_kernel at every size (moe.BULK_TOKENS)
                stack.enter_context(mock.patch.object(moe, "BULK_TOKENS", var["bulk_tokens"]))
            if "warp_stream" in var:  # the grouped GEMM at one token too (moe.WARP_STREAM)
                stack.enter_context(mock.patch.object(moe, "WARP_STREAM", var["warp_stream"]))
            if "shared_dense_tokens" in var:  # the shared expert's crossover from streaming to dequantise + cuBLAS
                stack.enter_context(mock.patch.object(moe, "SHARED_DENSE_TOKENS", var["shared_dense_tokens"]))
            yield

    specs = []
    for B in batches:
        for var in variants.values():
            with with_variant(var):
                specs += moe.experts_specs(routed, shared, B, TOPK, var.get("shared_down_splits", 1))
    grouped = {"bulk_tokens": 0, "warp_stream": 0}  # the probes are the grouped GEMM's (moe_kernel.PROBES)

    def grouped_specs(B):
        with with_variant(grouped):
            return moe.routed_specs(routed, B, TOPK)

    for B in batches if args.probes else ():  # the probed routed passes of the per-kernel breakdown
        specs += [sp + (probe,) for sp in grouped_specs(B) for probe in moe_kernel.PROBES[1:]]
    t0 = time.time()
    moe.precompile(specs)
    print(f"compiled {len(set(specs))} kernels in {time.time() - t0:.0f} s", flush=True)

    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                copy_bw=bw, shape=dict(experts=E, top_k=TOPK, hidden=HID, inter=INTER), sweep=args.sweep,
                skew=args.skew)
    try:
        import tilelang
        meta["tilelang"] = tilelang.__version__
    except Exception:  # noqa: BLE001
        pass
    rows, breakdown, breakdown_failed = [], [], []

    def targets():
        """Issue 21's MoE target: the default policy at >= 85% of copy bandwidth at B = 1, 8, 64 (None: not run)."""
        out = []
        for B in TARGET_BATCHES:
            frac = next((r.get("kernel_frac_bw") for r in rows if r["B"] == B), None)
            out.append(dict(name=f"MoE decode at B={B}, % of copy bandwidth (skew {args.skew})",
                            measured=None if frac is None else 100 * frac, target=85.0, unit="%",
                            met=frac is not None and frac >= 0.85))
        return out

    def flush():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(portable_json(dict(meta=meta, targets=on_card(targets(), meta["device"]), rows=rows,
                                       kernels=breakdown, jit=jit_stats())))

    # log popularity of each expert (a random rank order); Gumbel noise + top-k samples without replacement
    log_pop = -args.skew * torch.log1p(torch.randperm(E, device=dev, generator=g).float())

    def route(B):
        u = torch.rand(B, E, device=dev, generator=g).clamp_min(1e-20)
        return (log_pop - torch.log(-torch.log(u))).topk(TOPK, dim=-1).indices

    per_expert = 3 * HID * INTER * FP4_W
    shared_bytes = 3 * HID * INTER * FP8_W
    for B in batches:
        xs = [torch.randn(B, HID, device=dev, generator=g).bfloat16() for _ in range(SETS)]
        ids = [route(B) for _ in range(SETS)]
        wts = [torch.rand(B, TOPK, device=dev, generator=g) + 0.1 for _ in range(SETS)]
        touched = statistics.mean(len(torch.unique(t)) for t in ids)
        busiest = statistics.mean(int(torch.bincount(t.flatten(), minlength=E).max()) for t in ids)
        nbytes = touched * per_expert + shared_bytes + B * HID * 2 * 2 + B * TOPK * 12
        run_torch = lambda i: torch_moe.moe_experts(xs[i % SETS], wts[i % SETS], ids[i % SETS], routed, shared, LIMIT)
        ref = run_torch(0)
        ms_torch = timeit(run_torch, iters=3, warmup=1)
        row = dict(B=B, experts_touched=touched, busiest_expert_tokens=busiest, bytes=nbytes, torch_us=ms_torch * 1e3)
        for name, var in variants.items():
            with with_variant(var):
                splits = var.get("shared_down_splits", 1)
                run = lambda i: moe.moe_experts_packed(xs[i % SETS], wts[i % SETS], ids[i % SETS], routed, shared,
                                                       LIMIT, splits)
                out = run(0)
                torch.cuda.synchronize()
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                finite = bool(torch.isfinite(out).all())
                ms = graph_ms(run)
            key = name.replace(" ", "_")
            row[f"{key}_us"] = ms * 1e3 if ms else None
            row[f"{key}_rel_err_vs_torch"] = err
            row[f"{key}_finite"] = finite
            if ms:
                row[f"{key}_tbs"] = nbytes / (ms * 1e-3) / 1e12
                row[f"{key}_frac_bw"] = nbytes / (ms * 1e-3) / bw
                row[f"{key}_speedup_vs_torch"] = ms_torch / ms
        rows.append(row)
        flush()
        print(f"B={B:4d}: {touched:.1f} experts touched (the busiest: {busiest:.0f} tokens), {nbytes / 1e6:.1f} MB",
              flush=True)
        fmt_row = "  {:24s} {:9.1f} us {:6.2f} TB/s {:6.1f}% bw"
        print(f"  {'torch op':24s} {row['torch_us']:9.1f} us", flush=True)
        for name in variants:
            key = name.replace(" ", "_")
            if row.get(f"{key}_us"):
                print(fmt_row.format(name, row[f"{key}_us"], row[f"{key}_tbs"], 100 * row[f"{key}_frac_bw"])
                      + f"  x{row[f'{key}_speedup_vs_torch']:.1f} vs torch  rel err vs torch "
                      f"{row[f'{key}_rel_err_vs_torch']:.1e}",
                      flush=True)

        # ---- the kernels alone (the default policy), to see which pass falls short
        tables = [moe.routing_table(ids[i], wts[i], E) for i in range(SETS)]
        r_up, r_down = moe.routed_specs(routed, B, TOPK)
        s_up, s_down = moe.ffn_specs(shared, moe.shared_block_t(B))
        hs = [torch.empty(B * TOPK, INTER, dtype=torch.bfloat16, device=dev) for _ in range(SETS)]
        hsh = [torch.empty(B, INTER, dtype=torch.bfloat16, device=dev) for _ in range(4)]
        y = torch.zeros(B, HID, dtype=torch.float32, device=dev)
        stab = moe._shared_table(B, str(torch.device(dev)), moe.shared_block_t(B))
        w_up, w_dn = touched * 2 * INTER * HID * FP4_W, touched * HID * INTER * FP4_W
        a_up, a_dn = moe.pass_args(r_up, routed.w13), moe.pass_args(r_down, routed.w2)  # the bulk passes' maps
        kern = [
            ("routed up (fp4, SwiGLU)", w_up, lambda i: jit(*r_up)(xs[i % SETS], *tables[i % SETS], routed.w13,
                                                                   routed.s13, hs[i % SETS], LIMIT, *a_up)),
            ("routed down (fp4, add)", w_dn, lambda i: jit(*r_down)(hs[i % SETS], *tables[i % SETS], routed.w2,
                                                                    routed.s2, y, LIMIT, *a_dn)),
            ("shared up (fp8, SwiGLU)", 2 * INTER * HID * FP8_W, lambda i: jit(*s_up)(
                xs[i % SETS], *stab, shared_copies[i % 4].w13, shared_copies[i % 4].s13, hsh[i % 4], LIMIT)),
            ("shared down (fp8, add)", HID * INTER * FP8_W, lambda i: jit(*s_down)(
                hsh[i % 4], *stab, shared_copies[i % 4].w2, shared_copies[i % 4].s2, y, LIMIT)),
        ]
        g_up, g_down = grouped_specs(B)
        for probe in (moe_kernel.PROBES[1:] if args.probes else ()):  # the grouped GEMM's routed passes without a
            kern += [                                                  # part of their work
                (f"routed up grouped {probe}", w_up, lambda i, p=probe: jit(*g_up, p)(
                    xs[i % SETS], *tables[i % SETS], routed.w13, routed.s13, hs[i % SETS], LIMIT)),
                (f"routed down grouped {probe}", w_dn, lambda i, p=probe: jit(*g_down, p)(
                    hs[i % SETS], *tables[i % SETS], routed.w2, routed.s2, y, LIMIT))]
        specs_k = [r_up, r_down, s_up, s_down] + [sp + (p,) for p in (moe_kernel.PROBES[1:] if args.probes else ())
                                                  for sp in (g_up, g_down)]
        if "bulk" in variants:  # the bulk-copy routed passes alone beside the default's (moe.BULK_TOKENS)
            with with_variant(variants["bulk"]):
                b_up, b_down = moe.routed_specs(routed, B, TOPK)
            m_up, m_dn = moe.pass_args(b_up, routed.w13), moe.pass_args(b_down, routed.w2)
            kern += [("routed up bulk", w_up, lambda i: jit(*b_up)(xs[i % SETS], *tables[i % SETS], routed.w13,
                                                                   routed.s13, hs[i % SETS], LIMIT, *m_up)),
                     ("routed down bulk", w_dn, lambda i: jit(*b_down)(hs[i % SETS], *tables[i % SETS], routed.w2,
                                                                       routed.s2, y, LIMIT, *m_dn))]
            specs_k += [b_up, b_down]
        for (kname, kbytes, fn), spec in zip(kern, specs_k):
            ms = graph_ms(fn)
            if not ms:  # a pass that did not run is a failure of the run, not a missing line (exit non-zero)
                breakdown_failed.append(f"B={B} kernel {kname}")
            else:
                rec = dict(B=B, kernel=kname, us=ms * 1e3, bytes=kbytes, tbs=kbytes / (ms * 1e-3) / 1e12,
                           frac_bw=kbytes / (ms * 1e-3) / bw, spec=[str(a) for a in spec[1:]])
                breakdown.append(rec)
                print(f"    kernel {kname:24s} {rec['us']:8.1f} us {kbytes / 1e6:7.1f} MB {rec['tbs']:5.2f} TB/s "
                      f"{100 * rec['frac_bw']:5.1f}% bw", flush=True)
        flush()

    bad = [r for r in rows for k, v in r.items() if (k.endswith("rel_err_vs_torch") and not v < 1e-2)
           or (k.endswith("_finite") and not v)]
    not_run = [f"B={r['B']} {name}" for r in rows for name in variants if r.get(f"{name.replace(' ', '_')}_us") is None]
    not_run += breakdown_failed
    bad += not_run
    print(f"\nself-check: kernel vs torch relative error {'OK (< 1e-2)' if not bad else 'FAILED'}"
          + (f"; did not run: {', '.join(not_run)}" if not_run else "") + "; "
          f"total {time.time() - t_start:.0f} s; wrote {args.out}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
