"""Sink attention over per-query key slates (the registered `sink_attention`'s contract: bf16 keys [K, D] per
query, K = V, an additive [K] bias row): shared-latent MQA with 64 heads and a per-head sink, split over keys.

One block owns (query token, key split): the 64 heads are the wgmma M side, a block of 64 keys the N side of
QK^T and the K side of PV; logits and the softmax in fp32. Each split writes un-normalised O with its running
max m and sum l for attention_combine_kernel, or, with one split, the same block applies the sink:
out = sum_i O_i e^(m_i-M) / (sum_i l_i e^(m_i-M) + e^(sink-M)).
(The decode path over the FP8/FP4 caches is attention_decode_kernel.)
"""

import tilelang.language as T

NEG_INF = -1.0e30  # finite "minus infinity": keeps exp(m_prev - m_new) free of inf - inf


def build_sink_attention_dense(heads: int = 64, dim: int = 512, block_key: int = 64, splits: int = 1,
                               threads: int = 256):
    H, D, BKEY = heads, dim, block_key
    assert H == 64 and D % 64 == 0
    n_q, n_keys = T.dynamic("n_q"), T.dynamic("n_keys")
    single = splits == 1

    @T.macro
    def load_dense(bq_, kb, kv_s, valid_s, kv, bias):
        for r, d in T.Parallel(BKEY, D):
            kv_s[r, d] = T.if_then_else(kb * BKEY + r < n_keys, kv[bq_, T.min(kb * BKEY + r, n_keys - 1), d],
                                        T.cast(0, "bfloat16"))
        for j in T.Parallel(BKEY):
            valid_s[j] = T.if_then_else(kb * BKEY + j < n_keys,
                                        T.if_then_else(bias[bq_, T.min(kb * BKEY + j, n_keys - 1)] > NEG_INF, 1.0, 0.0),
                                        0.0)

    @T.macro
    def body(bq, bs, q, sink, scale, out, o_part, ml_part, kv, bias):
        q_s = T.alloc_shared((H, D), "bfloat16")
        kv_s = T.alloc_shared((BKEY, D), "bfloat16")
        p_s = T.alloc_shared((H, BKEY), "bfloat16")
        valid_s = T.alloc_shared((BKEY,), "float32")
        s_f = T.alloc_fragment((H, BKEY), "float32")
        o_f = T.alloc_fragment((H, D), "float32")
        m_f = T.alloc_fragment((H,), "float32")
        m_prev = T.alloc_fragment((H,), "float32")
        l_f = T.alloc_fragment((H,), "float32")
        rowsum = T.alloc_fragment((H,), "float32")
        alpha = T.alloc_fragment((H,), "float32")

        for h, d in T.Parallel(H, D):
            q_s[h, d] = q[bq, h, d]
        T.fill(m_f, NEG_INF)
        T.clear(l_f)
        T.clear(o_f)
        nb = T.ceildiv(n_keys, BKEY)
        per = T.ceildiv(nb, splits)
        for it in T.serial(per):
            kb = bs * per + it
            if kb < nb:
                T.sync_threads()
                load_dense(bq, kb, kv_s, valid_s, kv, bias)
                T.sync_threads()
                T.gemm(q_s, kv_s, s_f, transpose_B=True, clear_accum=True)
                for h, j in T.Parallel(H, BKEY):
                    s_f[h, j] = T.if_then_else(valid_s[j] > 0, s_f[h, j] * scale
                                               + bias[bq, T.min(kb * BKEY + j, n_keys - 1)], NEG_INF)
                T.copy(m_f, m_prev)
                T.reduce_max(s_f, m_f, dim=1, clear=False)
                for h in T.Parallel(H):
                    alpha[h] = T.exp(m_prev[h] - m_f[h])
                for h, j in T.Parallel(H, BKEY):
                    s_f[h, j] = T.if_then_else(s_f[h, j] > 0.5 * NEG_INF, T.exp(s_f[h, j] - m_f[h]), 0.0)
                T.reduce_sum(s_f, rowsum, dim=1)
                for h in T.Parallel(H):
                    l_f[h] = l_f[h] * alpha[h] + rowsum[h]
                for h, d in T.Parallel(H, D):
                    o_f[h, d] *= alpha[h]
                T.copy(s_f, p_s)
                T.gemm(p_s, kv_s, o_f)
        if single:
            for h in T.Parallel(H):
                # the sink joins the denominator only
                alpha[h] = T.max(m_f[h], sink[h])
                rowsum[h] = T.exp(m_f[h] - alpha[h]) / (l_f[h] * T.exp(m_f[h] - alpha[h]) + T.exp(sink[h] - alpha[h]))
            for h, d in T.Parallel(H, D):
                out[bq, h, d] = T.cast(o_f[h, d] * rowsum[h], "bfloat16")
        else:
            for h, d in T.Parallel(H, D):
                o_part[bq, bs, h, d] = o_f[h, d]
            for h in T.Parallel(H):
                ml_part[bq, bs, 0, h] = m_f[h]
                ml_part[bq, bs, 1, h] = l_f[h]

    @T.prim_func
    def sink_attention_dense(
        q: T.Tensor((n_q, H, D), "bfloat16"),
        kv: T.Tensor((n_q, n_keys, D), "bfloat16"),
        bias: T.Tensor((n_q, n_keys), "float32"),
        sink: T.Tensor((H,), "float32"),
        out: T.Tensor((n_q, H, D), "bfloat16"),
        o_part: T.Tensor((n_q, splits, H, D), "float32"),
        ml_part: T.Tensor((n_q, splits, 2, H), "float32"),
        scale: T.float32,
    ):
        with T.Kernel(splits, n_q, threads=threads) as (bs, bq):
            body(bq, bs, q, sink, scale, out, o_part, ml_part, kv, bias)

    return sink_attention_dense
