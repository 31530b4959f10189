"""MoE router: gate logits (bf16 tensor cores, fp32 accumulation, split over K) and a per-token fused
score -> biased top-k -> unbiased weights -> normalise -> scale kernel.

Why two kernels: the gate GEMV at decode reads a 384 x 5120 bf16 matrix (3.9 MB); splitting K over 20 blocks per
64-expert tile spreads that read over ~120 SMs, while top-k needs every expert of a token in one block.
build_router_fused (a candidate) makes them one launch up to a token tile: the tile's last block to finish selects.
Ties in the biased top-k go to the lower expert id (torch.topk leaves tie order unspecified).
"""

import tilelang.language as T

from .counters import LD_CG_SOURCE, count_in

SCORES = ("sqrtsoftplus", "sigmoid")


def _logits_tile(BT: int, BK: int, BE: int, steps: int):
    """The macro of one (expert tile bx, token tile by, K split bz) block: its partial logits into part."""

    @T.macro
    def tile(x, w, part, n_tok, bx, by, bz):
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

    return tile


def build_router_logits(n_experts: int, dim: int, block_t: int = 16, block_k: int = 256, splits: int = 20,
                        block_e: int = 64, threads: int = 128):
    """part[s, t, e] = sum over K-split s of x[t, k] * W[e, k] (fp32)."""
    E, D, BT, BK, S, BE = n_experts, dim, block_t, block_k, splits, block_e
    assert E % BE == 0 and D % (BK * S) == 0
    tile = _logits_tile(BT, BK, BE, D // (BK * S))
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def router_logits(
        x: T.Tensor((n_tok, D), "bfloat16"),
        w: T.Tensor((E, D), "bfloat16"),
        part: T.Tensor((S, n_tok, E), "float32"),
    ):
        with T.Kernel(E // BE, T.ceildiv(n_tok, BT), S, threads=threads) as (bx, by, bz):
            tile(x, w, part, n_tok, bx, by, bz)

    return router_logits


def _score(scoring: str, logit):
    """The expert's score from its logit: torch's softplus (beta 1, threshold 20) under a square root, or the
    sigmoid (both kernels the same expression, so the same bits)."""
    if scoring == "sqrtsoftplus":
        return T.sqrt(T.if_then_else(logit > 20.0, logit, T.log1p(T.exp(logit))))
    return T.sigmoid(logit)


def _key(score_plus_bias, e):
    """(order-preserving int32 image of the biased score) << 32 | (1023 - e): one int64 max picks the best score
    and, on a tie, the lower expert id."""
    bits = T.reinterpret(score_plus_bias, "int32")
    ordered = T.if_then_else(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return T.cast(ordered, "int64") * T.int64(4294967296) + T.cast(1023 - e, "int64")


def build_router_fused(n_experts: int, dim: int, splits: int, top_k: int, scoring: str, normalize: bool,
                       counters: int, block_t: int = 16, block_k: int = 256, block_e: int = 64, threads: int = 128):
    """build_router_logits and build_router_topk in one launch, for up to a token tile at decode: (x, w, part,
    bias, weights, ids, counters [C] int32 all zero, inv_temp, scaling). The last of a token tile's E / BE x S
    blocks to finish (counters.count_in on counters[tile]) selects every token of the tile, a warp a token, reading
    the partials past L1. Each token's logits are summed in split order, scored, keyed and weighted by the same
    expressions as build_router_topk's (ties to the lower id), so weights and ids are the two launches' bits; one
    launch fewer a layer, and no block-wide barrier in the selection (a warp's max is five shuffles)."""
    assert scoring in SCORES
    E, D, BT, BK, S, BE, K = n_experts, dim, block_t, block_k, splits, block_e, top_k
    assert E % BE == 0 and D % (BK * S) == 0 and E % 32 == 0 and E <= 1024 and threads % 32 == 0
    tile = _logits_tile(BT, BK, BE, D // (BK * S))
    L, warps, blocks = E // 32, threads // 32, (E // BE) * S
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def router_fused(
        x: T.Tensor((n_tok, D), "bfloat16"),
        w: T.Tensor((E, D), "bfloat16"),
        part: T.Tensor((S, n_tok, E), "float32"),
        bias: T.Tensor((E,), "float32"),
        weights: T.Tensor((n_tok, K), "float32"),
        ids: T.Tensor((n_tok, K), "int64"),
        cnt: T.Tensor((counters,), "int32"),
        inv_temp: T.float32,
        scaling: T.float32,
    ):
        with T.Kernel(E // BE, T.ceildiv(n_tok, BT), S, threads=threads) as (bx, by, bz):
            T.import_source(LD_CG_SOURCE)
            tile(x, w, part, n_tok, bx, by, bz)
            arrived = T.alloc_shared((1,), "int32")
            score_s = T.alloc_shared((warps, E), "float32")
            key = T.alloc_local((L,), "int64")
            sel = T.alloc_local((K,), "int32")
            tx = T.get_thread_binding()
            lane, wp = tx % 32, tx // 32
            count_in(cnt, by, arrived, tx)
            if arrived[0] == blocks - 1:
                T.call_extern("handle", "__threadfence")
                for r in T.serial(T.ceildiv(BT, warps)):
                    t = by * BT + r * warps + wp
                    if r * warps + wp < BT and t < n_tok:  # the same for a warp's lanes
                        for j in T.unroll(L):
                            e = j * 32 + lane
                            logit = T.alloc_var("float32", init=0.0)
                            for s in T.serial(S):
                                logit = logit + T.call_extern("float32", "di_ld_cg", T.address_of(part[s, t, e]))
                            logit = logit * inv_temp
                            score = _score(scoring, logit)
                            score_s[wp, e] = score
                            key[j] = _key(score + bias[e], e)
                        for k in T.unroll(K):
                            best = T.alloc_var("int64", init=T.min_value("int64"))
                            for j in T.unroll(L):
                                best = T.max(best, key[j])
                            for o in T.unroll(5):
                                best = T.max(best, T.shfl_xor(best, 16 >> o))
                            win = 1023 - T.cast(best & T.int64(0xFFFFFFFF), "int32")
                            for j in T.unroll(L):
                                if j * 32 + lane == win:
                                    key[j] = T.min_value("int64")
                            sel[k] = win
                        T.call_extern("handle", "__syncwarp")  # the lanes' scores, seen by lane 0
                        if lane == 0:
                            total = T.alloc_var("float32", init=0.0)
                            for k in T.unroll(K):  # in k order, as build_router_topk's serial loops
                                total = total + score_s[wp, sel[k]]
                            for k in T.unroll(K):
                                wk = score_s[wp, sel[k]]
                                if normalize and K > 1:
                                    wk = wk / (total + 1e-20)
                                weights[t, k] = wk * scaling
                                ids[t, k] = T.cast(sel[k], "int64")
                        T.call_extern("handle", "__syncwarp")  # lane 0 done reading before the next token
                if tx == 0:
                    cnt[by] = 0

    return router_fused


def build_router_topk(n_experts: int, splits: int, top_k: int, scoring: str, normalize: bool,
                      threads: int = 128):
    """One block per token: logits = sum of split partials / temp; score; top-k of score + bias; weights.

    Top-k runs as k rounds of a block-wide max over 64-bit keys (order-preserving bits of the biased score in
    the high word, ~expert id in the low word), so one max picks the best score and, on a tie, the lower id."""
    assert scoring in SCORES
    E, S, K = n_experts, splits, top_k
    assert E <= 1024, "expert id must fit the key's low word"
    J = -(-E // threads)
    warps = threads // 32
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
                        logit = logit + part[s, t, e]
                logit = logit * inv_temp
                score[j] = _score(scoring, logit)
                score_s[e] = score[j]
                # order-preserving int32 image of the float, then (key << 32) | (1023 - e) as one int64 (_key)
                bits = T.reinterpret(score[j] + bias[T.min(e, E - 1)], "int32")
                ordered = T.if_then_else(bits < 0, bits ^ 0x7FFFFFFF, bits)
                key[j] = T.if_then_else(e < E, T.cast(ordered, "int64") * T.int64(4294967296) + T.cast(1023 - e, "int64"),
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

    return router_topk
