"""MoE router: gate logits (bf16 tensor cores, fp32 accumulation, split over K) and a per-token fused
score -> biased top-k -> unbiased weights -> normalise -> scale kernel.

Why two kernels: the gate GEMV at decode reads a 384 x 5120 bf16 matrix (3.9 MB); splitting K over 20 blocks per
64-expert tile spreads that read over ~120 SMs, while top-k needs every expert of a token in one block. At decode
sizes `build_router_fused` does both in one launch (moe.ROUTER_FUSED_TOKENS): a token tile's last block to finish
its partials runs the top-k, one launch fewer a layer.
Ties in the biased top-k go to the lower expert id (torch.topk leaves tie order unspecified).
"""

import tilelang.language as T

from .counters import LD_CG_SOURCE, TILE_COUNTERS, count_in

SCORES = ("sqrtsoftplus", "sigmoid")


def _logits_tile(E: int, D: int, BT: int, BK: int, S: int, BE: int):
    """T.macro: block (bx, by, bz)'s partials, part[bz, tokens of tile by, experts of tile bx] = the sum over K-split
    bz of x[t, k] * W[e, k] (bf16 tensor cores, fp32)."""
    assert E % BE == 0 and D % (BK * S) == 0
    steps = D // (BK * S)

    @T.macro
    def logits(x, w, part, n_tok, bx, by, bz):
        w_s = T.alloc_shared((BE, BK), "bfloat16")
        x_s = T.alloc_shared((BT, BK), "bfloat16")
        acc = T.alloc_fragment((BE, BT), "float32")
        T.clear(acc)
        for k in T.Pipelined(steps, num_stages=2):
            T.copy(w[bx * BE, (bz * steps + k) * BK], w_s)
            T.copy(x[by * BT, (bz * steps + k) * BK], x_s)
            T.gemm(w_s, x_s, acc, transpose_B=True)
        for i, j in T.Parallel(BE, BT):
            if by * BT + j < n_tok:
                part[bz, by * BT + j, bx * BE + i] = acc[i, j]

    return logits


def build_router_logits(n_experts: int, dim: int, block_t: int = 16, block_k: int = 256, splits: int = 20,
                        block_e: int = 64, threads: int = 128):
    """part[s, t, e] = sum over K-split s of x[t, k] * W[e, k] (fp32)."""
    E, D, BT, S, BE = n_experts, dim, block_t, splits, block_e
    logits = _logits_tile(E, D, BT, block_k, S, BE)
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def router_logits(
        x: T.Tensor((n_tok, D), "bfloat16"),
        w: T.Tensor((E, D), "bfloat16"),
        part: T.Tensor((S, n_tok, E), "float32"),
    ):
        with T.Kernel(E // BE, T.ceildiv(n_tok, BT), S, threads=threads) as (bx, by, bz):
            logits(x, w, part, n_tok, bx, by, bz)

    return router_logits


def _topk_token(E: int, S: int, K: int, scoring: str, normalize: bool, threads: int, past_l1: bool):
    """T.macro: token t's logits (the split partials summed in split order / temp), scores, biased top-k and
    weights, by one block of `threads` (build_router_topk's body; past_l1: the partials read past L1, as a last block
    reads the other blocks' stores). It allocates its own registers and shared buffers, and ends with a barrier, so a
block may run it for several tokens in turn."""
    assert scoring in SCORES
    assert E <= 1024, "expert id must fit the key's low word"
    J = -(-E // threads)
    warps = threads // 32

    @T.macro
    def topk(part, bias, weights, ids, t, inv_temp, scaling, tx):
        score = T.alloc_local((J,), "float32")
        key = T.alloc_local((J,), "int64")
        red_s = T.alloc_shared((K, warps), "int64")
        sel_s = T.alloc_shared((K,), "int32")
        score_s = T.alloc_shared((J * threads,), "float32")
        for j in T.unroll(J):
            e = j * threads + tx
            logit = T.alloc_var("float32", init=0.0)
            if e < E:
                for s in T.serial(S):
                    if past_l1:
                        logit = logit + T.call_extern("float32", "di_ld_cg", T.address_of(part[s, t, e]))
                    else:
                        logit = logit + part[s, t, e]
            logit = logit * inv_temp
            if scoring == "sqrtsoftplus":
                # torch softplus (beta 1, threshold 20)
                score[j] = T.sqrt(T.if_then_else(logit > 20.0, logit, T.log1p(T.exp(logit))))
            else:
                score[j] = T.sigmoid(logit)
            score_s[e] = score[j]
            # order-preserving int32 image of the float, then (key << 32) | (1023 - e) as one int64
            bits = T.reinterpret(score[j] + bias[T.min(e, E - 1)], "int32")
            ordered = T.if_then_else(bits < 0, bits ^ 0x7FFFFFFF, bits)
            key[j] = T.if_then_else(e < E,
                                    T.cast(ordered, "int64") * T.int64(4294967296) + T.cast(1023 - e, "int64"),
                                    T.min_value("int64"))
        for k in T.unroll(K):
            best = T.alloc_var("int64", init=T.min_value("int64"))
            for j in T.unroll(J):
                best = T.max(best, key[j])
            for o in T.unroll(5):
                best = T.max(best, T.shfl_xor(best, 16 >> o))
            if tx % 32 == 0:
                red_s[k, tx // 32] = best
            T.sync_threads()
            for w_ in T.unroll(warps):
                best = T.max(best, red_s[k, w_])
            win = 1023 - T.cast(best & T.int64(0xFFFFFFFF), "int32")
            for j in T.unroll(J):
                if j * threads + tx == win:
                    key[j] = T.min_value("int64")
            if tx == 0:
                sel_s[k] = win
        T.sync_threads()
        if tx == 0:
            total = T.alloc_var("float32", init=0.0)
            for k in T.serial(K):
                total = total + score_s[sel_s[k]]
            for k in T.serial(K):
                wk = score_s[sel_s[k]]
                if normalize and K > 1:
                    wk = wk / (total + 1e-20)
                weights[t, k] = wk * scaling
                ids[t, k] = T.cast(sel_s[k], "int64")
        T.sync_threads()

    return topk


def build_router_topk(n_experts: int, splits: int, top_k: int, scoring: str, normalize: bool,
                      threads: int = 128):
    """One block per token: logits = sum of split partials / temp; score; top-k of score + bias; weights.

    Top-k runs as k rounds of a block-wide max over 64-bit keys (order-preserving bits of the biased score in
    the high word, ~expert id in the low word), so one max picks the best score and, on a tie, the lower id."""
    E, S, K = n_experts, splits, top_k
    topk = _topk_token(E, S, K, scoring, normalize, threads, False)
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def router_topk(
        part: T.Tensor((S, n_tok, E), "float32"),
        bias: T.Tensor((E,), "float32"),
        weights: T.Tensor((n_tok, K), "float32"),
        ids: T.Tensor((n_tok, K), "int64"),
        inv_temp: T.float32,
        scaling: T.float32,
    ):
        with T.Kernel(n_tok, threads=threads) as t:
            tx = T.get_thread_binding()
            topk(part, bias, weights, ids, t, inv_temp, scaling, tx)

    return router_topk


def build_router_fused(n_experts: int, dim: int, top_k: int, scoring: str, normalize: bool, block_t: int = 16,
                       block_k: int = 256, splits: int = 20, counters: int = TILE_COUNTERS, block_e: int = 64,
                       threads: int = 128):
    """build_router_logits then build_router_topk in one launch: each block writes its partials as router_logits
    does and counts in on counters[token tile] (counters.count_in); the last of a token tile's E/64 x splits blocks
    runs router_topk's body for the tile's tokens in turn, reading the partials past L1, and zeroes the counter.
    The same sums in the same order as the two launches: the same bits. (x, w, part, bias, weights, ids, inv_temp,
    scaling, counters [C] int32 zeros)."""
    E, D, BT, S, BE, K = n_experts, dim, block_t, splits, block_e, top_k
    logits = _logits_tile(E, D, BT, block_k, S, BE)
    blocks_per_tile = (E // BE) * S
    topk = _topk_token(E, S, K, scoring, normalize, threads, True)
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def router_fused(
        x: T.Tensor((n_tok, D), "bfloat16"),
        w: T.Tensor((E, D), "bfloat16"),
        part: T.Tensor((S, n_tok, E), "float32"),
        bias: T.Tensor((E,), "float32"),
        weights: T.Tensor((n_tok, K), "float32"),
        ids: T.Tensor((n_tok, K), "int64"),
        inv_temp: T.float32,
        scaling: T.float32,
        cnt: T.Tensor((counters,), "int32"),
    ):
        with T.Kernel(E // BE, T.ceildiv(n_tok, BT), S, threads=threads) as (bx, by, bz):
            T.import_source(LD_CG_SOURCE)
            arrived = T.alloc_shared((1,), "int32")
            tx = T.get_thread_binding()
            logits(x, w, part, n_tok, bx, by, bz)
            count_in(cnt, by, arrived, tx)
            if arrived[0] == blocks_per_tile - 1:
                T.call_extern("handle", "__threadfence")
                for i in T.serial(BT):
                    if by * BT + i < n_tok:
                        topk(part, bias, weights, ids, by * BT + i, inv_temp, scaling, tx)
                if tx == 0:
                    cnt[by] = 0

    return router_fused
