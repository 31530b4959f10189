"""Lightning-indexer scores: I[s, g] = sum_h w[s, h] * relu(q[s, h] . k[g]) * scale, on tensor cores.

The (query, head) rows are the wgmma M side: "dense" packs two queries x 32 heads into 64 rows against bf16 keys;
"fp4" gives each query its own block (rows 32..63 zero) because its keys come from its own sequence's FP4
indexer cache (e2m1 + ue8m0 per 32 channels, dequantised in registers, dequant.py) and stops at its visible
count (entries past it score -inf). It reads the keys where the cache pool holds them, through each sequence's
entry -> pool row table (a pool block's entries are contiguous), so no step copies a sequence's keys out of the
pool first: that gather (torch indexing of 64- and 4-byte rows) cost more than the scoring it fed, and grew with
batch x context. The relu, head weights and head sum run on the fp32 accumulator.
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE, fp4_perm

NEG_INF = float("-inf")


def build_indexer_scores(source: str, heads: int = 32, dim: int = 128, block_g: int = 128, threads: int = 128,
                         tiles: int = 1):
    """tiles ("fp4"): key tiles of block_g entries one block scores in turn for its query (the query's q loaded
    once for them all; the launcher picks it so the grid still fills the GPU)."""
    assert source in ("dense", "fp4") and heads <= 64 and 64 % heads == 0
    assert tiles == 1 or source == "fp4"
    Hh, Dd, BG, TILES = heads, dim, block_g, tiles
    QPB = 64 // heads if source == "dense" else 1  # queries per block
    n_q, n_g, n_seq, n_rows = T.dynamic("n_q"), T.dynamic("n_g"), T.dynamic("n_seq"), T.dynamic("n_rows")
    chunks = BG * Dd // 8 // threads
    assert threads % (Dd // 8) == 0

    @T.macro
    def finish(bq, bg, acc, c_s, weights, scores, scale, limit):
        T.copy(acc, c_s)
        for qq, j in T.Parallel(QPB, BG):
            s = bq * QPB + qq
            if s < n_q and bg * BG + j < n_g:
                tot = T.alloc_var("float32", init=0.0)
                for h in T.serial(Hh):
                    tot = tot + T.max(c_s[qq * Hh + h, j], 0.0) * weights[s, h]
                scores[s, bg * BG + j] = T.if_then_else(bg * BG + j < limit(s), tot * scale, NEG_INF)

    if source == "dense":

        @T.prim_func
        def indexer_scores_dense(
            q: T.Tensor((n_q, Hh, Dd), "bfloat16"),
            k: T.Tensor((n_g, Dd), "bfloat16"),
            weights: T.Tensor((n_q, Hh), "float32"),
            scores: T.Tensor((n_q, n_g), "float32"),
            scale: T.float32,
        ):
            with T.Kernel(T.ceildiv(n_g, BG), T.ceildiv(n_q, QPB), threads=threads) as (bg, bq):
                q_s = T.alloc_shared((64, Dd), "bfloat16")
                k_s = T.alloc_shared((BG, Dd), "bfloat16")
                acc = T.alloc_fragment((64, BG), "float32")
                c_s = T.alloc_shared((64, BG), "float32")
                for r, d in T.Parallel(64, Dd):
                    q_s[r, d] = T.if_then_else(bq * QPB + r // Hh < n_q,
                                               q[T.min(bq * QPB + r // Hh, n_q - 1), r % Hh, d], T.cast(0, "bfloat16"))
                T.copy(k[bg * BG, 0], k_s)
                T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True)
                finish(bq, bg, acc, c_s, weights, scores, scale, lambda s: n_g)

        return indexer_scores_dense

    @T.prim_func
    def indexer_scores_fp4(
        q: T.Tensor((n_q, Hh, Dd), "bfloat16"),
        q_seq: T.Tensor((n_q,), "int32"),
        visible: T.Tensor((n_q,), "int32"),
        k: T.Tensor((n_rows, Dd // 2), "uint8"),
        k_scale: T.Tensor((n_rows, Dd // 32), "uint8"),
        rows: T.Tensor((n_seq, n_g), "int64"),
        weights: T.Tensor((n_q, Hh), "float32"),
        scores: T.Tensor((n_q, n_g), "float32"),
        scale: T.float32,
    ):
        with T.Kernel(T.ceildiv(n_g, BG * TILES), n_q, threads=threads) as (bx, bq):
            q_s = T.alloc_shared((64, Dd), "bfloat16")
            k_s = T.alloc_shared((BG, Dd), "bfloat16")
            acc = T.alloc_fragment((64, BG), "float32")
            c_s = T.alloc_shared((64, BG), "float32")
            prow = T.alloc_local((chunks,), "int64")
            sc = T.alloc_local((chunks,), "uint8")
            packed = T.alloc_local((chunks * 4,), "uint8")
            vals = T.alloc_local((8,), "bfloat16")
            tx = T.get_thread_binding()
            T.import_source(CUDA_SOURCE)
            b = q_seq[bq]
            gch = tx % (Dd // 8)  # the thread's 8-channel chunk, the same in every pass (threads % (Dd/8) == 0)
            if bx * TILES * BG < visible[bq]:  # the query's q once for all the block's key tiles
                for r, d in T.Parallel(64, Dd):
                    q_s[r, d] = T.if_then_else(r < Hh, q[bq, r % Hh, fp4_perm(d)], T.cast(0, "bfloat16"))
            for t in T.serial(TILES):
                bg = bx * TILES + t
                T.sync_threads()  # the previous tile's readers of k_s / c_s are done
                if bg * BG < visible[bq]:
                    # pool rows, then every key load of the thread, then the dequant: the loads are all in flight
                    for i in T.unroll(chunks):
                        prow[i] = rows[b, T.min(bg * BG + (i * threads + tx) // (Dd // 8), n_g - 1)]
                    for i in T.unroll(chunks):
                        for v in T.vectorized(4):
                            packed[i * 4 + v] = k[prow[i], gch * 4 + v]
                        sc[i] = k_scale[prow[i], gch // 4]
                    for i in T.unroll(chunks):
                        T.call_extern("handle", "di_dq_e2m1x8", T.address_of(packed[i * 4]), sc[i],
                                      T.address_of(vals[0]))
                        for v in T.vectorized(8):
                            k_s[(i * threads + tx) // (Dd // 8), gch * 8 + v] = vals[v]
                    T.sync_threads()
                    T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True)
                    finish(bq, bg, acc, c_s, weights, scores, scale, lambda s: visible[s])
                else:
                    for j in T.Parallel(BG):
                        if bg * BG + j < n_g:
                            scores[bq, bg * BG + j] = NEG_INF

    return indexer_scores_fp4
