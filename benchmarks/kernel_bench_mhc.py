"""mHC kernels (tilelang-sm90) at DeepSeek-V4.1-Flash shapes (hc = 4, D = 5120, fn [24, 20480] fp32), next to the
torch ops and, where `import tile_kernels` works, DeepSeek tile-kernels' `mhc_post_fwd` (= our expand) and
`mhc_pre_apply_mix_fwd` (= our collapse). Wired into benchmarks/kernels_gpu.py as

    bench(functools.partial(record, rows), measure, bw, peak, batches, with_torch)

(or pass rows=rows and record unbound). Bytes are the fewest each call must move: every input read once, every
output written once (the mixes' split partials are not counted). Inputs rotate over several sets so repeated
calls do not hit in L2; fn rotates over 40 copies (80 MB > L2), as each mHC site of the model has its own.
"""

import math

import torch

HC, D, ITERS, EPS = 4, 5120, 20, 1e-6
N, K = (2 + HC) * HC, HC * D
PREFILL = 8192
DEV = "cuda"


def _tile_kernels():
    try:
        import tile_kernels  # noqa: F401
        from tile_kernels.mhc import mhc_post_fwd, mhc_pre_apply_mix_fwd
        return mhc_post_fwd, mhc_pre_apply_mix_fwd
    except Exception as exc:  # noqa: BLE001 - absent or broken: benchmark without it
        print("tile-kernels unavailable:", type(exc).__name__, str(exc)[:200], flush=True)
        return None


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench(record, measure, bw, peak, batches=(1, 8, 64, 256), with_torch=True, rows=None):
    from deepinfer.kernels.tilelang import mhc as tl_mhc
    from deepinfer.kernels.torch import mhc as ref

    rec = (lambda *a, **k: record(rows, *a, **k)) if rows is not None else record
    tk = _tile_kernels()
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(5)
    fns = [torch.randn(N, K, device=dev, generator=g) * 0.02 for _ in range(40)]
    scale = torch.rand(3, device=dev, generator=g) + 0.5
    base = torch.randn(N, device=dev, generator=g) * 0.5

    for B in (*batches, PREFILL):
        per_call = B * K * 2 * 3  # streams + expand output, roughly
        sets = max(2, min(16, math.ceil(400e6 / per_call)))
        streams = [torch.randn(B, HC, D, device=dev, generator=g).bfloat16() for _ in range(sets)]
        xs = [torch.randn(B, D, device=dev, generator=g).bfloat16() for _ in range(sets)]
        mixes = [tl_mhc.mhc_mixes(s, fns[i % 40], scale, base, EPS, ITERS, EPS) for i, s in enumerate(streams)]
        calls = 8 if B <= 256 else 2
        tag = "prefill " if B == PREFILL else ""

        # ---- mixes
        run = lambda i: tl_mhc.mhc_mixes(streams[i % sets], fns[i % 40], scale, base, EPS, ITERS, EPS)
        ms, mn, eg = measure(run, calls=calls)
        t_ms = None
        if with_torch:
            t_ms = measure(lambda i: ref.mhc_mixes(streams[i % sets], fns[i % 40], scale, base, EPS, ITERS, EPS),
                           calls=calls)[0]
        splits = tl_mhc._splits(B, K // tl_mhc.BLOCK_K)
        note = (f"gemv, {tl_mhc.GEMV_SPLITS} blocks (mhc.GEMV_TOKENS {tl_mhc.GEMV_TOKENS})"
                if tl_mhc.gemv_fits(B, HC, D) else f"splits {splits}")
        if B in (1, 64):
            # K-split sweep (each a compile): the automatic choice is in SPLITS
            sweep = []
            for s in (16, 64, 160):
                f = lambda i, s=s: tl_mhc.mixes_with_splits(streams[i % sets], fns[i % 40], scale, base, EPS, ITERS,
                                                             EPS, s)
                sweep.append(f"S={s}: {measure(f, calls=calls)[0] * 1e3:.1f} us")
            note += "; sweep " + ", ".join(sweep)
        nbytes = B * K * 2 + N * K * 4 + B * (2 * HC + HC * HC) * 4 + (3 + N) * 4
        rec("mhc_mixes", f"{tag}T={B} hc=4 D=5120", ms, mn, nbytes, 2 * B * K * (N + 1), bw, peak, t_ms,
            note=note, eager_ms=eg)

        # ---- collapse
        pres = [m[0] for m in mixes]
        run = lambda i: tl_mhc.mhc_collapse(streams[i % sets], pres[i % sets])
        ms, mn, eg = measure(run, calls=calls)
        t_ms = None
        if with_torch:
            t_ms = measure(lambda i: ref.mhc_collapse(streams[i % sets], pres[i % sets]), calls=calls)[0]
        note = ""
        if tk is not None:
            try:
                outs = [torch.empty(B, D, dtype=torch.bfloat16, device=dev) for _ in range(sets)]
                tk_run = lambda i: tk[1](streams[i % sets], pres[i % sets], outs[i % sets])
                tk_run(0)
                diff = _rel(outs[0], tl_mhc.mhc_collapse(streams[0], pres[0]))
                tk_ms = measure(tk_run, calls=calls)[0]
                note = (f"tile-kernels mhc_pre_apply_mix_fwd {tk_ms * 1e3:.1f} us = {tk_ms / ms:.2f}x ours "
                        f"(rel diff {diff:.1e})")
            except Exception as exc:  # noqa: BLE001
                note = f"tile-kernels failed: {type(exc).__name__}: {str(exc)[:120]}"
        nbytes = B * K * 2 + B * D * 2 + B * HC * 4
        rec("mhc_collapse", f"{tag}T={B} hc=4 D=5120", ms, mn, nbytes, 2 * B * K, bw, peak, t_ms, note=note,
            eager_ms=eg)

        # ---- expand
        run = lambda i: tl_mhc.mhc_expand(xs[i % sets], streams[i % sets], mixes[i % sets][1], mixes[i % sets][2])
        ms, mn, eg = measure(run, calls=calls)
        t_ms = None
        if with_torch:
            t_ms = measure(lambda i: ref.mhc_expand(xs[i % sets], streams[i % sets], mixes[i % sets][1],
                                                    mixes[i % sets][2]), calls=calls)[0]
        note = ""
        if tk is not None:
            try:
                outs = [torch.empty(B, HC, D, dtype=torch.bfloat16, device=dev) for _ in range(sets)]
                tk_run = lambda i: tk[0](xs[i % sets].view(1, B, D), streams[i % sets].view(1, B, HC, D),
                                         mixes[i % sets][1].view(1, B, HC, 1), mixes[i % sets][2].view(1, B, HC, HC),
                                         out=outs[i % sets].view(1, B, HC, D))
                tk_run(0)
                diff = _rel(outs[0], tl_mhc.mhc_expand(xs[0], streams[0], mixes[0][1], mixes[0][2]))
                tk_ms = measure(tk_run, calls=calls)[0]
                note = f"tile-kernels mhc_post_fwd {tk_ms * 1e3:.1f} us = {tk_ms / ms:.2f}x ours (rel diff {diff:.1e})"
            except Exception as exc:  # noqa: BLE001
                note = f"tile-kernels failed: {type(exc).__name__}: {str(exc)[:120]}"
        nbytes = B * D * 2 + 2 * B * K * 2 + B * (HC + HC * HC) * 4
        rec("mhc_expand", f"{tag}T={B} hc=4 D=5120", ms, mn, nbytes, 2 * B * K * (HC + 1), bw, peak, t_ms,
            note=note, eager_ms=eg)
        del streams, xs, mixes
        torch.cuda.empty_cache()


def main():
    """Standalone: python3 benchmarks/kernel_bench_mhc.py [--out FILE] [--quick] [--no-torch] (ceilings, record and
    measure from kernels_gpu.py; the JSON's meta, targets and rows as kernels_gpu.py's)."""
    import argparse
    import json
    import os
    import sys
    import time

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernels_gpu as kg

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kernels_gpu_mhc.json")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 64 (+ prefill)")
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    bw, peak = kg.ceilings()
    print(f"ceilings: copy {bw/1e12:.2f} TB/s, bf16 GEMM {peak/1e12:.0f} TFLOP/s", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    rows = []
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak,
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), cmd=" ".join(sys.argv))
    # issue 6 names no mHC target (its kernel targets are kernels_gpu.py's and layer_gpu.py's), so no kg._flush:
    # it would write kernels_gpu's MoE/attention targets here, unmeasured
    out = dict(meta=meta, targets=[], rows=rows)

    def record(*args, **kw):  # kg.record, the JSON rewritten per row: a run cut at its time limit keeps its rows
        kg.record(rows, *args, **kw)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    bench(record, kg.measure, bw, peak, (1, 64) if a.quick else (1, 8, 64, 256), not a.no_torch)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
