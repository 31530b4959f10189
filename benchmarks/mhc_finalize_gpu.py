"""The mHC mixes' second kernel (`mhc_mix_finalize`) alone on the GPU, beside its first (`mhc_premix`): where a
decode step's 80 finalize calls (two mHC sites a layer, 40 layers) spend their time.

Time = median per call of CUDA-event-timed replays of a CUDA graph of 16 calls on 8 distinct input sets
(kernels_gpu.graph_time). Rows: n_tok x K-split count x Sinkhorn rounds; the split count only changes how many
partials a warp sums, the rounds the serial 4x4 normalisations one thread per token runs. No roofline: the kernel
moves a few KB; its time is latency. No issue names a target for it (`targets: []`).

    source benchmarks/gpu_env.sh && python3 benchmarks/mhc_finalize_gpu.py --out $OUT/mhc_finalize_h200.json
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import graph_time  # noqa: E402

HC, D = 4, 5120
N = (2 + HC) * HC


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="mhc_finalize_gpu.json")
    ap.add_argument("--tokens", default="1,64,256")
    args = ap.parse_args()
    from deepinfer.kernels.tilelang._build import jit
    from deepinfer.kernels.tilelang.mhc_kernel import NOUT, build_mhc_mix_finalize, build_mhc_premix

    dev, rows = "cuda", []
    g = torch.Generator(device=dev).manual_seed(0)
    for n_tok in (int(t) for t in args.tokens.split(",")):
        for splits, iters in ((64, 20), (64, 1), (16, 20), (1, 20)):
            parts = [torch.randn(splits, n_tok, NOUT, device=dev, generator=g) for _ in range(8)]
            for p in parts:  # the sum of squares column: positive, as the premix writes it
                p[:, :, N] = p[:, :, N].abs() * 1000
            scale = torch.rand(3, device=dev, generator=g) + 0.5
            base = torch.randn(N, device=dev, generator=g)
            pre, post = torch.empty(n_tok, HC, device=dev), torch.empty(n_tok, HC, device=dev)
            comb = torch.empty(n_tok, HC, HC, device=dev)
            kernel = jit(build_mhc_mix_finalize, HC, D, splits, iters)
            t = graph_time(lambda i: kernel(parts[i % 8], scale, base, pre, post, comb, 1e-6, 1e-6), calls=16)
            if t is None or not torch.isfinite(comb).all():
                raise SystemExit(f"finalize n_tok={n_tok} splits={splits} rounds={iters}: did not run or not finite")
            rows.append(dict(kernel="mhc_mix_finalize", n_tok=n_tok, splits=splits, sinkhorn_iters=iters,
                             us=t[0] * 1e3, min_us=t[1] * 1e3))
            print(f"finalize n_tok={n_tok:4d} splits={splits:3d} sinkhorn={iters:2d}: {t[0] * 1e3:7.2f} us "
                  f"(min {t[1] * 1e3:.2f})", flush=True)
        x = [torch.randn(n_tok, HC * D, device=dev, generator=g).bfloat16() for _ in range(8)]
        fns = [torch.randn(N, HC * D, device=dev, generator=g) for _ in range(40)]  # 40 x 2 MB: beyond L2
        part = torch.empty(64, n_tok, NOUT, device=dev)
        kernel = jit(build_mhc_premix, HC, D, 64, 64, 64, 5)
        t = graph_time(lambda i: kernel(x[i % 8], fns[i % 40], part), calls=16)
        if t is None:
            raise SystemExit(f"premix n_tok={n_tok}: did not run")
        rows.append(dict(kernel="mhc_premix", n_tok=n_tok, splits=64, us=t[0] * 1e3, min_us=t[1] * 1e3))
        print(f"premix   n_tok={n_tok:4d} splits= 64: {t[0] * 1e3:7.2f} us", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, targets=[], rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
