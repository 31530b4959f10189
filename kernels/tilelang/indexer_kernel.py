"""Lightning-indexer scores: I[s, g] = sum_h w[s, h] * relu(q[s, h] . k[g]) * scale, on tensor cores.

The (query, head) rows are the wgmma M side: "dense" packs two queries x 32 heads into 64 rows against bf16 keys;
"fp4" reads each query's keys from its own sequence's FP4 indexer cache (e2m1 + ue8m0 per 32 channels,
dequantised in registers, dequant.py) and stops at its visible count (entries past it score -inf). A block takes one
query (decode: rows 32..63 zero) or two consecutive ones (a prefill chunk: one dequantised key tile serves both,
where one query a block dequantised every tile again for each query), and loads the next key tile's bytes while the
current tile is multiplied and summed (before: the loads, the dequantisation and the MMA in series). It reads the
keys where the cache pool holds them, through each sequence's entry -> pool row table (a pool block's entries are
contiguous), so no step copies a sequence's keys out of the pool first: that gather (torch indexing of 64- and
4-byte rows) cost more than the scoring it fed, and grew with batch x context. The relu, head weights and head sum
run on the fp32 accumulator.
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE, fp4_perm

NEG_INF = float("-inf")


def build_indexer_scores(source: str, heads: int = 32, dim: int = 128, block_g: int = 128, threads: int = 128,
                         tiles: int = 1, queries: int = 1):
    """tiles ("fp4"): key tiles of block_g entries one block scores in turn for its queries (their q loaded once
    for them all; the launcher picks it so the grid still fills the GPU). queries ("fp4"): consecutive queries a
    block scores together, each tile of keys dequantised once for those of one sequence (a prefill chunk's
    queries: 2 fill the 64 MMA rows with 32 heads); queries of different sequences take a pass each."""
    assert source in ("dense", "fp4") and heads <= 64 and 64 % heads == 0
    assert tiles == 1 or source == "fp4"
    assert queries * heads <= 64 and (queries == 1 or source == "fp4")
    Hh, Dd, BG, TILES = heads, dim, block_g, tiles
    QPB = 64 // heads if source == "dense" else queries  # queries per block
    R = 64  # MMA rows (one warpgroup's): 128 rows over two warpgroups (four queries) measured slower than 64
    n_q, n_g, n_seq, n_rows = T.dynamic("n_q"), T.dynamic("n_g"), T.dynamic("n_seq"), T.dynamic("n_rows")
    chunks = BG * Dd // 8 // threads
    assert threads % (Dd // 8) == 0

    @T.macro
    def finish(bq, bg, acc, c_s, weights, scores, scale):
        T.copy(acc, c_s)
        for qq, j in T.Parallel(QPB, BG):
            s = bq * QPB + qq
            if s < n_q and bg * BG + j < n_g:
                tot = T.alloc_var("float32", init=0.0)
                for h in T.serial(Hh):
                    tot = tot + T.max(c_s[qq * Hh + h, j], 0.0) * weights[s, h]
                scores[s, bg * BG + j] = tot * scale

    @T.macro
    def fetch_rows(rows, bg, b, prow, tx):
        for i in T.unroll(chunks):
            prow[i] = rows[b, T.min(bg * BG + (i * threads + tx) // (Dd // 8), n_g - 1)]

    @T.macro
    def fetch_keys(k, k_scale, prow, packed, sc, gch):
        for i in T.unroll(chunks):
            for v in T.vectorized(4):
                packed[i * 4 + v] = k[prow[i], gch * 4 + v]
            sc[i] = k_scale[prow[i], gch // 4]

    @T.macro
    def finish_fp4(visible, s0, bg, acc, c_s, w_s, scores, scale, n_pass, p, last):
        T.copy(acc, c_s[0:R, 0:BG])
        for qq, j in T.Parallel(QPB, BG):
            s = s0 + qq
            if s <= last and (n_pass == 1 or qq == p) and bg * BG + j < n_g:
                tot = T.alloc_var("float32", init=0.0)
                for h in T.unroll(Hh):
                    tot = tot + T.max(c_s[qq * Hh + h, j], 0.0) * w_s[qq * Hh + h]
                scores[s, bg * BG + j] = T.if_then_else(bg * BG + j < visible[s], tot * scale, NEG_INF)

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
                finish(bq, bg, acc, c_s, weights, scores, scale)

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
        with T.Kernel(T.ceildiv(n_g, BG * TILES), T.ceildiv(n_q, QPB), threads=threads) as (bx, bq):
            q_s = T.alloc_shared((R, Dd), "bfloat16")
            k_s = T.alloc_shared((BG, Dd), "bfloat16")
            w_s = T.alloc_shared((R,), "float32")
            acc = T.alloc_fragment((R, BG), "float32")
            c_s = T.alloc_shared((R, BG + 8), "float32")  # padded: a half-warp's 8-byte stores of acc hit 32 banks
            prow = T.alloc_local((chunks,), "int64")
            sc = T.alloc_local((chunks,), "uint8")
            packed = T.alloc_local((chunks * 4,), "uint8")
            vals = T.alloc_local((8,), "bfloat16")
            tx = T.get_thread_binding()
            T.import_source(CUDA_SOURCE)
            s0 = bq * QPB
            last = T.min(s0 + QPB, n_q) - 1  # the block's last query
            # one pass per sequence among the block's queries: queries of one sequence share its dequantised keys
            n_pass = T.if_then_else(q_seq[last] == q_seq[s0], 1, last - s0 + 1)
            reach = T.max(visible[s0], visible[last])  # the entries any query of the block may see
            gch = tx % (Dd // 8)  # the thread's 8-channel chunk, the same in every pass (threads % (Dd/8) == 0)
            if bx * TILES * BG < reach:  # the queries' q and head weights once for all the block's key tiles
                for r, d in T.Parallel(R, Dd):
                    q_s[r, d] = T.if_then_else(r < QPB * Hh and s0 + r // Hh <= last,
                                               q[T.min(s0 + r // Hh, last), r % Hh, fp4_perm(d)],
                                               T.cast(0, "bfloat16"))
                for r in T.Parallel(R):
                    w_s[r] = T.if_then_else(r < QPB * Hh and s0 + r // Hh <= last,
                                            weights[T.min(s0 + r // Hh, last), r % Hh], 0.0)
            for p in T.serial(QPB):
                if p < n_pass:
                    b = q_seq[s0 + p]
                    # the pass's entries: the block's reach in one pass, else its own query's
                    lim = T.if_then_else(n_pass == 1, reach, visible[s0 + p])
                    if bx * TILES * BG < lim:  # the first tile's rows and keys, the second tile's rows
                        fetch_rows(rows, bx * TILES, b, prow, tx)
                        fetch_keys(k, k_scale, prow, packed, sc, gch)
                        fetch_rows(rows, bx * TILES + 1, b, prow, tx)
                    for t in T.serial(TILES):
                        bg = bx * TILES + t
                        T.sync_threads()  # the previous tile's readers of k_s / c_s are done
                        if bg * BG < lim:
                            for i in T.unroll(chunks):
                                T.call_extern("handle", "di_dq_e2m1x8", T.address_of(packed[i * 4]), sc[i],
                                              T.address_of(vals[0]))
                                for v in T.vectorized(8):
                                    k_s[(i * threads + tx) // (Dd // 8), gch * 8 + v] = vals[v]
                            # the next tile's keys (its rows came a tile ago) and the one after's rows: in flight
                            # under this tile's MMA and head sums
                            if t + 1 < TILES and (bg + 1) * BG < lim:
                                fetch_keys(k, k_scale, prow, packed, sc, gch)
                                if t + 2 < TILES:
                                    fetch_rows(rows, bg + 2, b, prow, tx)
                            T.sync_threads()
                            T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True)
                            finish_fp4(visible, s0, bg, acc, c_s, w_s, scores, scale, n_pass, p, last)
                        else:
                            for qq, j in T.Parallel(QPB, BG):
                                if s0 + qq <= last and (n_pass == 1 or qq == p) and bg * BG + j < n_g:
                                    scores[s0 + qq, bg * BG + j] = NEG_INF

    return indexer_scores_fp4
