"""Index top-k (tilelang-sm90, kernels/tilelang/topk_kernel.py) at DeepSeek-V4.1 decode shapes, next to the torch op
`index_topk`. Wired into benchmarks/kernels_gpu.py as

    bench(functools.partial(record, rows), measure, bw, peak, batches, contexts, with_torch)

(or pass rows=rows and record unbound). Standalone: `python3 benchmarks/kernel_bench_topk.py [--quick]` (measures
the copy ceiling itself and prints the rows).

Per context and batch B (one query per sequence, every entry visible): G = context / 2 entries (ratio-2 index
source), topk 512. Rows:
  index_topk_ids   decode fast path, ids [B, 512] int32 (the `sel` of sink_attention_decode)
  index_topk       the registered op: selected mask [B, G] bool
  index_topk+cand  the candidate-source layer: ids + candidate mask (best 2048 blocks of 8)
and one prefill row (4096 queries at 32K, causal visible counts). Bytes are the fewest each call must move: scores
read once, visible read once, each output written once. Inputs rotate over several sets so calls do not hit in L2
(B <= 8 at 4K stays L2-resident anyway: those rows are latency numbers). Each row notes whether the kernel's
selection equals the torch op's on one set (random normal scores: tie-free at the threshold).

tile-kernels: its only top-k, `tile_kernels.moe.topk_gate(scores, num_topk)`, selects <= 32 of a full row (no
visible count, no candidate blocks, int64 ids in score order): it does not fit this op (topk 512) and is not timed.
"""

import math

import torch

TOPK, KB, BS = 512, 2048, 8
PREFILL = 4096
DEV = "cuda"


def bench(record, measure, bw, peak, batches=(1, 8, 64, 256), contexts=(4096, 32768), with_torch=True, rows=None,
          prefill=PREFILL):
    from deepinfer.kernels.tilelang.topk import index_topk, index_topk_ids
    from deepinfer.kernels.torch import indexer as ref

    rec = (lambda *a, **k: record(rows, *a, **k)) if rows is not None else record
    g = torch.Generator(device=DEV).manual_seed(7)
    shapes = [(ctx, B, False) for ctx in contexts for B in batches]
    if prefill:
        shapes.append((max(contexts), prefill, True))
    for ctx, B, causal in shapes:
        G = ctx // 2
        per_call = B * G * 4
        sets = max(2, min(16, math.ceil(400e6 / per_call)))
        scores = [torch.randn(B, G, device=DEV, generator=g) for _ in range(sets)]
        if causal:  # the last B query positions of a ctx-token prompt
            vis = ((torch.arange(ctx - B, ctx, device=DEV) + 1) // 2).to(torch.int32)
        else:
            vis = torch.full((B,), G, dtype=torch.int32, device=DEV)
        calls = 8 if B <= 256 else 2
        tag = f"{'prefill ' if causal else ''}B={B} ctx={ctx // 1024}K G={G}"
        in_bytes = B * G * 4 + B * 4

        variants = [
            ("index_topk_ids", lambda i: index_topk_ids(scores[i % sets], vis, TOPK),
             lambda i: ref.index_topk(scores[i % sets], vis, TOPK), in_bytes + B * TOPK * 4),
            ("index_topk", lambda i: index_topk(scores[i % sets], vis, TOPK),
             lambda i: ref.index_topk(scores[i % sets], vis, TOPK), in_bytes + B * G),
            ("index_topk+cand", lambda i: index_topk_ids(scores[i % sets], vis, TOPK, None, KB, BS),
             lambda i: ref.index_topk(scores[i % sets], vis, TOPK, None, KB, BS), in_bytes + B * TOPK * 4 + B * G),
        ]
        for name, run, torch_run, nbytes in variants:
            note = _agreement(name, run(0), torch_run(0))
            ms, mn, eg = measure(run, calls=calls)
            t_ms = measure(torch_run, calls=calls)[0] if with_torch else None
            rec(name, tag, ms, mn, nbytes, 0, bw, peak, t_ms, note=note, eager_ms=eg)


def _agreement(name, out, expect):
    """'matches torch' when the kernel selected the same entries (and candidate blocks) as the torch op."""
    sel_ref, cand_ref = expect
    if name == "index_topk":
        same = torch.equal(out[0], sel_ref)
    else:
        ids, cand = out if isinstance(out, tuple) else (out, None)
        sel = torch.zeros_like(sel_ref)
        rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
        sel[rows[ids >= 0], ids[ids >= 0].long()] = True
        same = torch.equal(sel, sel_ref) and (cand is None or torch.equal(cand, cand_ref))
    return "matches torch" if same else "SELECTION DIFFERS FROM TORCH"


def main():
    import argparse
    import os
    import sys

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 64 only, no prefill row")
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernels_gpu as kg

    n = 1 << 28  # 1 GiB copy: the bandwidth ceiling the fractions refer to
    src = torch.rand(n, device=DEV)
    dst = torch.empty_like(src)
    copy_ms, _ = kg.timeit(lambda i: dst.copy_(src), iters=10)
    bw = 2 * n * 4 / (copy_ms * 1e-3)
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    bench(kg.record, kg.measure, bw, 1e15, batches=(1, 64) if a.quick else (1, 8, 64, 256),
          with_torch=not a.no_torch, rows=rows, prefill=0 if a.quick else PREFILL)


if __name__ == "__main__":
    main()
