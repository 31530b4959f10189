#!/usr/bin/env python3
"""The lightning indexer's scores at prefill sizes (issue 20 item 4): one 8K chunk of a prompt's queries against
its sequence's FP4 indexer keys read in the pool, causal (query i sees the entries compressed up to its position),
with one query a block (a key tile dequantised for each query) and with two (one tile for both, 64 MMA rows; the
launcher's pick for a prefill chunk, indexer.SHARED_QUERIES). Rate: the useful FLOPs (2 x 32 heads x 128 x the entries
each query sees) over the kernel's time, CUDA events, median of --iters calls; and % of the bf16 GEMM rate
measured in the same run. Checks, exit 1 when one fails: the two agree bit for bit, and sampled rows match the
float64 torch op (relative error < 1e-5).

    source benchmarks/gpu_env.sh && python3 benchmarks/indexer_prefill_gpu.py --out $OUT/indexer_prefill.json
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_gpu import ceilings, timeit  # noqa: E402
from wide_reduce_gpu import finish  # noqa: E402

HEADS, DIM, CHUNK = 32, 128, 8192
CELLS = ((1, 8192), (2, 8192), (1, 32768), (2, 32768))  # (compress ratio, prompt tokens): its last 8K chunk


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 2], help="queries a block (the first is "
                    "the bitwise reference of the others)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("a GPU is needed")
    from deepinfer.kernels.tilelang import indexer
    from deepinfer.kernels.tilelang._build import jit
    from deepinfer.kernels.torch import indexer as ref
    from deepinfer.kernels.torch import quant

    bw, peak = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    out = dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__, chunk=CHUNK,
                         bf16_tflops=peak / 1e12, queries=a.queries), rows=[], targets=[])  # no kernel target
    wrong = []
    for ratio, prompt in CELLS:
        G = prompt // ratio
        pos = torch.arange(prompt - CHUNK, prompt, device="cuda")
        visible = ((pos + 1) // ratio).clamp(min=1).int()
        q = quant.fake_quant_fp4(torch.randn(CHUNK, HEADS, DIM, device="cuda", generator=g), 32).bfloat16()
        w = torch.randn(CHUNK, HEADS, device="cuda", generator=g) * HEADS**-0.5
        pool = torch.randint(0, 256, (G + 1, DIM // 2), dtype=torch.uint8, device="cuda", generator=g)
        pool_scale = torch.randint(120, 128, (G + 1, DIM // 32), dtype=torch.uint8, device="cuda", generator=g)
        rows = torch.randperm(G, device="cuda", generator=g)[None]  # the entries' pool rows, scrambled
        seq = torch.zeros(CHUNK, dtype=torch.int32, device="cuda")
        flops = 2.0 * HEADS * DIM * visible.double().sum().item()
        tiles_of = {qpb: indexer.key_tiles(CHUNK, G, qpb) for qpb in a.queries}
        row = dict(ratio=ratio, prompt=prompt, entries=G, tflop=flops / 1e12, pick=indexer.queries_per_block(CHUNK, 1))
        first = None
        for qpb in a.queries:
            kernel = jit(*indexer.fp4_spec(HEADS, DIM, tiles_of[qpb], qpb))
            scores = torch.empty(CHUNK, G, device="cuda")
            call = lambda i: kernel(q, seq, visible, pool, pool_scale, rows, w, scores, DIM**-0.5)  # noqa: E731
            ms = timeit(call, iters=a.iters, warmup=2)[0]
            if first is None:
                first = scores.clone()
                keys = quant.dequant_fp4_rows(pool[rows[0]], pool_scale[rows[0]]).double()
                for i in (0, CHUNK // 2, CHUNK - 1):  # sampled rows against the float64 op
                    n = int(visible[i])
                    want = ref.indexer_scores(q[i : i + 1].double(), keys[None, :n], seq[:1].long(),
                                              w[i : i + 1].double(), DIM**-0.5)
                    err = ((scores[i : i + 1, :n].double() - want).norm() / want.norm()).item()
                    if not err < 1e-5 or not torch.isneginf(scores[i, n:]).all():
                        wrong.append(f"ratio {ratio} prompt {prompt} row {i} (rel err {err:.2e})")
            elif not torch.equal(scores, first):
                wrong.append(f"ratio {ratio} prompt {prompt}: {qpb} queries a block differ from {a.queries[0]}")
            rate = flops / (ms * 1e-3)
            row[f"q{qpb}"] = dict(ms=ms, tiles=tiles_of[qpb], tflops=rate / 1e12, pct_bf16=100 * rate / peak)
            print(f"ratio {ratio} prompt {prompt // 1024}K ({G} entries), {qpb} queries a block: {ms:7.3f} ms, "
                  f"{rate / 1e12:6.1f} TFLOP/s ({100 * rate / peak:4.1f}% of bf16)", flush=True)
        out["rows"].append(row)
    return finish(out, wrong, a.out, "indexer scores")


if __name__ == "__main__":
    sys.exit(main())
