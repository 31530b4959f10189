"""MoE router: gate logits (bf16 tensor cores, fp32 accumulation, split over K) and a per-token fused
score -> biased top-k -> unbiased weights -> normalise -> scale kernel.

Why two kernels: the gate GEMV at decode reads a 384 x 5120 bf16 matrix (3.9 MB); splitting K over 20 blocks per
64-expert tile spreads that read over ~120 SMs, while top-k needs every expert of a token in one block.
Ties in the biased top-k go to the lower expert id (torch.topk leaves tie order unspecified).
"""

import tilelang.language as T

SCORES = ("sqrtsoftplus", "sigmoid")


def build_router_logits(n_experts: int, dim: int, block_t: int = 16, block_k: int = 256, splits: int = 20,
                        block_e: int = 64, threads: int = 128):
    """part[s, t, e] = sum over K-split s of x[t, k] * W[e, k] (fp32)."""
    E, D, BT, BK, S, BE = n_experts, dim, block_t, block_k, splits, block_e
    assert E % BE == 0 and D % (BK * S) == 0
    steps = D // (BK * S)
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def router_logits(
        x: T.Tensor((n_tok, D), "bfloat16"),
        w: T.Tensor((E, D), "bfloat16"),
        part: T.Tensor((S, n_tok, E), "float32"),
    ):
        with T.Kernel(E // BE, T.ceildiv(n_tok, BT), S, threads=threads) as (bx, by, bz):
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

    return router_logits


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

    return router_topk
