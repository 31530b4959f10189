"""The mHC mixes at a few tokens a call (decode; mhc.GEMV_TOKENS, one by default) as a GEMV over fn's columns, in
one launch.

Why: the fused mixes (mhc_kernel.build_mhc_premix with counters) tile 64 tokens for the wgmma; at one token its 64
split blocks each run 5 pipelined K steps of a 64 x 80 MMA, 63 rows of it empty, and take ~13 us a call for ~2 MB of
fn (~0.7 us at the H100's bandwidth): 1.05 ms of a 40-layer B=1 step's ~11 (decode_gpu_flash40_nopdl_s27_h100).

Here block b owns columns [b * C, (b + 1) * C) of the flattened hc * D stream, C = threads x `cols` (one fp32 load
of each of fn's N rows a column, held in registers: every load of the block in flight at once); per token (a
serial loop: the columns' fn values stay in registers) each thread forms its N dots and the sum of squares in fp32
FMAs, the warps reduce them by shuffles and the block's four warp sums are added in warp order into part[b, t, :].
The last block to finish (counters.count_in, as the fused premix) sums each token's `splits` partials in block order
and finalizes its tokens (mhc_kernel's token_mixes: the same RMS scale, gates and Sinkhorn).

Numerics: fp32 products of the bf16 stream and fp32 fn (exact bf16 -> fp32, one rounding a product) summed in fp32
in a fixed order per token: not the tensor-core path's bits (three bf16 terms of fn), so never taken in the
batch-invariant mode, where every token count keeps the tiled premix's fixed split.
"""

import tilelang.language as T

from .counters import LD_CG_SOURCE
from .mhc_kernel import NOUT, RCP_SOURCE, last_block_finalize, mix_width

THREADS = 128


def build_mhc_mixes_gemv(hc: int, dim: int, splits: int, max_tokens: int, sinkhorn_iters: int, counters: int,
                         cols: int = 1, weights_before_wait: bool = False):
    """(x [n_tok, hc*D] bf16, fn [N, hc*D] fp32, part [splits, n_tok, NOUT] fp32, scale [3], base [N], pre [n_tok,
    hc], post [n_tok, hc], comb [n_tok, hc, hc], counters [C] int32 all zero, hc_eps, norm_eps): the fused mixes'
    arguments and outputs for n_tok <= max_tokens (the launcher's bound), `splits` blocks of THREADS x cols
    columns. weights_before_wait: as gemv_kernel's (fn's loads issued before the programmatic launch's wait; only
    for an fn no running kernel may write: a CUDA graph's)."""
    K, N, H = hc * dim, mix_width(hc), hc
    S, CPT = splits, cols
    C = THREADS * CPT
    warps = THREADS // 32
    assert N < NOUT and K == S * C and max_tokens >= 1 and sinkhorn_iters >= 1 and counters >= 1
    n_tok = T.dynamic("n_tok")
    rows = -(-max_tokens // warps) * warps  # the finalizing block's token rows, whole passes of its warps
    finalize = last_block_finalize(hc, dim, sinkhorn_iters, S, rows, warps)

    @T.prim_func
    def mhc_mixes_gemv(
        x: T.Tensor((n_tok, K), "bfloat16"),
        fn: T.Tensor((N, K), "float32"),
        part: T.Tensor((S, n_tok, NOUT), "float32"),
        scale: T.Tensor((3,), "float32"),
        base: T.Tensor((N,), "float32"),
        pre: T.Tensor((n_tok, H), "float32"),
        post: T.Tensor((n_tok, H), "float32"),
        comb: T.Tensor((n_tok, H, H), "float32"),
        cnt: T.Tensor((counters,), "int32"),
        hc_eps: T.float32,
        norm_eps: T.float32,
    ):
        with T.Kernel(S, threads=THREADS) as bx:
            T.import_source(RCP_SOURCE + LD_CG_SOURCE)
            f = T.alloc_local((N * CPT,), "float32")
            acc = T.alloc_local((N + 1,), "float32")
            xv = T.alloc_local((1,), "float32")
            total = T.alloc_local((1,), "float32")
            wsum = T.alloc_shared((warps, NOUT), "float32")
            out_s = T.alloc_shared((rows, NOUT + 1), "float32")  # the summed rows (odd stride: one a thread)
            arrived = T.alloc_shared((1,), "int32")
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            col = bx * C + tx  # this thread's columns: col, col + THREADS, ...
            for n in T.unroll(N):
                for j in T.unroll(CPT):
                    f[n * CPT + j] = fn[n, col + j * THREADS]
            if weights_before_wait:
                T.pdl_sync()  # the stream (the kernel before's output), the partials and the counters only from here
                T.pdl_trigger()
            for t in T.serial(n_tok):
                for c in T.unroll(N + 1):
                    acc[c] = T.float32(0)
                for j in T.unroll(CPT):
                    xv[0] = T.cast(x[t, col + j * THREADS], "float32")
                    for n in T.unroll(N):
                        acc[n] = acc[n] + xv[0] * f[n * CPT + j]
                    acc[N] = acc[N] + xv[0] * xv[0]
                for c in T.unroll(N + 1):
                    for o in T.unroll(5):
                        acc[c] = acc[c] + T.shfl_xor(acc[c], 16 >> o)
                if lane == 0:
                    for c in T.unroll(N + 1):
                        wsum[warp, c] = acc[c]
                T.sync_threads()
                if tx <= N:
                    total[0] = wsum[0, tx]
                    for w in T.unroll(warps - 1):
                        total[0] = total[0] + wsum[w + 1, tx]
                    part[bx, t, tx] = total[0]
                T.sync_threads()  # wsum is rewritten by the next token
            finalize(part, cnt, 0, 0, n_tok, out_s, arrived, total, tx, scale, base, pre, post, comb, hc_eps,
                     norm_eps)  # one tile: every token of the call

    return mhc_mixes_gemv
