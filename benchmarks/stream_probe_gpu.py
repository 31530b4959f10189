#!/usr/bin/env python3
"""How fast can the routed experts' FP4 bytes reach shared memory at decode? Five data paths, loads only
(kernels/tilelang/stream_probe_kernel.py: the grouped GEMM's cp.async + block barrier, moe_warp_kernel's per-warp
cp.async rings, and three bulk-copy (TMA engine) producers behind mbarriers: one copy a row a stage, one copy a stage
of a stage-tiled layout, one 2-D tensor copy a stage of the layout as it is), at the Flash expert shapes (384
experts, up pass 4608 x 5120, down 5120 x 2304), over the experts B tokens' uniform top-6 routing touches.

    source benchmarks/gpu_env.sh && python3 benchmarks/stream_probe_gpu.py --out $OUT/stream_probe.json \
        [--batches 1,8,64,256] [--modes block,warp,rows,tile,tma2d] [--stages 4,8] [--gemv wq_b,wo_b]

Why: on the H200 the grouped GEMM's own data path (its FP4 decode and MMAs left out) moved 76-84% of the copy
bandwidth at 8-64 tokens (moe_gpu_probe_h200.log), where issue 21 asks the whole MoE for 85%: the MoE's next
kernel is built on whichever path this shows can go past that.

Time = median per call of CUDA-event-timed replays of a CUDA graph of 4 calls on distinct expert sets. Bytes = the
touched experts' weight rows and block scales (0.5 + 1/32 B a weight); % = of the device-to-device copy bandwidth
measured in the same run (roofline.py's denominator). Self-check: every block folds (XOR) every 32-bit word of its
rows and scales it received; the fold is checked against torch's over the same bytes, so a path that drops or
misplaces bytes fails the run (exit 1), as does a variant that did not run.
"""

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import graph_time, timeit  # noqa: E402  (one timing method for every GPU benchmark)
from target_card import on_card  # noqa: E402
from decode_gpu import portable_json  # noqa: E402

E, TOPK, HID, INTER = 384, 6, 5120, 2304
PASSES = {"up": (2 * INTER, HID), "down": (HID, INTER)}  # (rows N, K)
SETS = 4
GEMV_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_a_group": (1024, 4096),
               "wo_b": (5120, 8192), "indexer_wq_b": (4096, 1280)}  # (N, K) e4m3, benchmarks/linear_gpu.py's
TARGET = 0.85  # issue 21: MoE decode >= 85% of the bandwidth at B = 1, 8, 64; its data path must go past it


def copy_bandwidth():
    src = torch.rand(1 << 29, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = timeit(lambda i: dst.copy_(src), iters=20)[0]
    return 2 * (1 << 29) * 4 / (ms * 1e-3)


def xor_fold(t: torch.Tensor) -> torch.Tensor:
    """XOR of each row's 32-bit words ([n, m] int32 -> [n])."""
    while t.shape[1] > 1:
        if t.shape[1] % 2:
            t = torch.cat([t, torch.zeros_like(t[:, :1])], 1)
        t = t[:, 0::2] ^ t[:, 1::2]
    return t[:, 0]


def expected_fold(w, ws, experts, rows=64):
    """[n_slots, N / 64]: the XOR of every word of each block's weight rows and scales."""
    n = w.shape[1] // rows
    out = []
    for e in experts.tolist():
        a = xor_fold(w[e].reshape(n, -1).view(torch.int32))
        b = xor_fold(ws[e].reshape(n, -1).view(torch.int32))
        out.append(a ^ b)
    return torch.stack(out)


def expert_sets(batch: int, g) -> list[torch.Tensor]:
    """SETS sets of the distinct experts a batch's uniform top-6 routing touches."""
    sets = []
    for _ in range(SETS):
        scores = torch.rand(batch, E, device="cuda", generator=g)
        idx = scores.topk(TOPK, dim=1).indices
        sets.append(torch.unique(idx).to(torch.int32))
    return sets


def main():
    from deepinfer.kernels.tilelang import moe_bulk_kernel, stream_probe_kernel as sp
    from deepinfer.kernels.tilelang._build import jit

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="stream_probe.json")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--modes", default=",".join(sp.MODES))
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--gemv", default="",
                    help=f"also the one-token FP8 projections' shapes, comma-separated: {','.join(GEMV_SHAPES)}")
    args = ap.parse_args()
    unknown = [p for p in args.gemv.split(",") if args.gemv and p not in GEMV_SHAPES]
    if unknown:
        ap.error(f"--gemv: unknown {unknown}; allowed: {list(GEMV_SHAPES)}")
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in modes if m not in sp.MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; allowed: {list(sp.MODES)}")
    stages = [int(s) for s in args.stages.split(",")]
    t0 = time.time()
    gpu = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = {p: (torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device="cuda", generator=g),
                   torch.randint(0, 256, (E, n, k // 32), dtype=torch.uint8, device="cuda", generator=g))
               for p, (n, k) in PASSES.items()}
    bw = copy_bandwidth()
    print(f"device {gpu}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows, failures = [], []
    result = {"device": gpu, "host": platform.node(), "copy_bandwidth": bw, "command": " ".join(sys.argv),
              "rows": rows}

    def write():
        with open(args.out, "w") as f:
            f.write(portable_json(result))

    def measure(label: str, batch, p: str, w, ws, sets: list, n_slots: float, nbytes: float):
        """Every (mode, stages) over `sets` (one call a set, a graph of them all), checked by the folds."""
        e_, n, kp = w.shape
        k = 2 * kp
        want = [expected_fold(w, ws, s) for s in sets]
        tmap = moe_bulk_kernel.weight_map(w)  # read by "tma2d" only
        for mode in modes:
            for st in stages:
                name = f"{mode} s{st}"
                try:
                    kern = jit(sp.build_stream_probe, mode, e_, n, k, 256, st)
                    outs = [torch.zeros(len(s), n // 64, sp.threads(mode), dtype=torch.int32, device="cuda")
                            for s in sets]
                    for s, o in zip(sets, outs):
                        kern(w, ws, s, o, tmap)
                    torch.cuda.synchronize()
                    ok = all(torch.equal(xor_fold(o.view(-1, o.shape[-1])).view(o.shape[:2]), x)
                             for o, x in zip(outs, want))
                    gt = graph_time(lambda i: kern(w, ws, sets[i % len(sets)], outs[i % len(sets)], tmap),
                                    calls=len(sets))
                    if gt is None:
                        raise RuntimeError("graph capture failed")
                    ms = gt[0]
                except Exception as exc:  # noqa: BLE001 - named at the end, the run fails
                    failures.append(f"{label} {p} {name}: {type(exc).__name__}: {str(exc)[:300]}")
                    print("FAILED", failures[-1], flush=True)
                    continue
                frac = nbytes / (ms * 1e-3) / bw
                row = {"batch": batch, "pass": p, "mode": mode, "stages": st, "experts": n_slots, "ms": ms,
                       "bytes": nbytes, "tb_s": nbytes / (ms * 1e-3) / 1e12, "frac_copy_bw": frac, "fold_ok": ok}
                rows.append(row)
                if not ok:
                    failures.append(f"{label} {p} {name}: the fold of the received bytes is wrong")
                print(f"{label:6s} {p:5s} {name:8s} {n_slots:6.1f} mats {ms * 1e3:9.1f} us {row['tb_s']:5.2f} TB/s "
                      f"{100 * frac:5.1f}% of copy bw{'' if ok else '  FOLD WRONG'}", flush=True)
                write()

    for b in batches:
        sets = expert_sets(b, g)
        n_slots = sum(len(s) for s in sets) / SETS
        for p, (n, k) in PASSES.items():
            w, ws = weights[p]
            measure(f"B={b}", b, p, w, ws, sets, n_slots, n_slots * n * (k // 2 + k // 32))
    del weights
    for p in args.gemv.split(",") if args.gemv else ():
        # one token's FP8 projection as the probe's bytes: an [N, K] e4m3 matrix is [N, 2K] FP4 codes (its block
        # scales here 1/16 of a byte a weight, not 1/1024: 6% more bytes, counted); copies past 160 MB so the
        # graph's calls read HBM, not L2. 64-row blocks and no K split: N / 64 blocks a call, so a projection of
        # few rows shows the wave it would need splits for
        n, k8 = GEMV_SHAPES[p]
        copies = max(SETS, -(-160_000_000 // (n * k8)))
        w = torch.randint(0, 256, (copies, n, k8), dtype=torch.uint8, device="cuda", generator=g)
        ws = torch.randint(0, 256, (copies, n, k8 // 16), dtype=torch.uint8, device="cuda", generator=g)
        sets = [torch.tensor([i], dtype=torch.int32, device="cuda") for i in range(copies)]
        measure(f"gemv {n // 64} blocks", 1, p, w, ws, sets, 1.0, n * (k8 + k8 // 16))
        del w, ws
    targets = []
    for b in (1, 8, 64):
        cand = [r for r in rows if r["batch"] == b and r["fold_ok"] and r["pass"] in PASSES]
        if not cand:
            continue
        total = {}
        for r in cand:  # both passes of one (mode, stages): bytes over time, as the MoE runs them
            t = total.setdefault((r["mode"], r["stages"]), [0.0, 0.0, 0])
            t[0] += r["bytes"]
            t[1] += r["ms"]
            t[2] += 1
        best = max((v[0] / (v[1] * 1e-3) / bw, key) for key, v in total.items() if v[2] == len(PASSES))
        targets.append({"name": f"routed data path, loads only, best mode ({best[1][0]} s{best[1][1]}), B={b}: a "
                                f"bound on MoE decode >= {TARGET:.0%} of the bandwidth",
                        "measured": round(best[0], 4), "target": TARGET, "unit": "fraction of copy bandwidth",
                        "met": best[0] >= TARGET})
    result["targets"] = on_card(targets, gpu)
    result["seconds"] = time.time() - t0
    write()
    for t in result["targets"]:
        print(f"target {t['name']}: {t['measured']:.3f} (>= {t['target']}) met={t['met']} "
              f"(on this card: {t.get('met_on_this_card', t['met'])})")
    if failures:
        print(f"{len(failures)} variant(s) failed:", *failures, sep="\n  ")
        sys.exit(1)
    print(f"total {time.time() - t0:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
