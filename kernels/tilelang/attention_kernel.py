"""Decode attention kernel: shared-latent MQA (K = V, 64 heads x 512) with a per-head sink, split over keys.

One block owns (query token, key split): the 64 heads are the wgmma M side, a block of 64 keys the N side of
QK^T and the K side of PV. Key sources ("source"):
  "paged": keys [0, W) come from the sequence's FP8 window ring (e4m3 + ue8m0 per 32 channels), keys
           [W, W + topk) from the FP4 compressed pool rows the indexer selected (e2m1 + e4m3 per 16 channels);
           both are dequantised in registers straight into the bf16 shared tile (dequant.py). A window key is
           visible when q_pos - window < key_pos <= q_pos; a compressed key when its selected row is >= 0.
  "dense": each query's own key slate, bf16 [K, D], with an additive [K] bias row (the torch op's contract).
The dequant emits the head dim in a twiddled order; Q is loaded in that order and O stored back in natural order.

Each split writes un-normalised O with its running max m and sum l; the combine kernel (or, with one split,
the same block) applies the sink: out = sum_i O_i e^(m_i-M) / (sum_i l_i e^(m_i-M) + e^(sink-M)).
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE, fp4_perm

NEG_INF = -1.0e30  # finite "minus infinity": keeps exp(m_prev - m_new) free of inf - inf


def build_sink_attention(source: str, heads: int = 64, dim: int = 512, window: int = 128, topk: int = 512,
                         block_key: int = 64, splits: int = 1, threads: int = 256):
    assert source in ("paged", "dense")
    H, D, W, BKEY = heads, dim, window, block_key
    assert H == 64 and D % 64 == 0
    if source == "paged":
        assert W % BKEY == 0 and topk % BKEY == 0
    n_blocks_static = (W + topk) // BKEY
    n_q, n_seq, n_pool, n_keys = T.dynamic("n_q"), T.dynamic("n_seq"), T.dynamic("n_pool"), T.dynamic("n_keys")
    chunks = BKEY * D // 8 // threads  # 8-element dequant chunks per thread per key block
    single = splits == 1

    @T.macro
    def load_paged(bq_, kb, kv_s, valid_s, packed, vals, tx, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv,
                   cmp_scale, sel):
        b = q_seq[bq_]
        p = q_pos[bq_]
        if kb * BKEY < W:
            for i in T.serial(chunks):
                r = (i * threads + tx) // (D // 8)
                g = (i * threads + tx) % (D // 8)
                for v in T.vectorized(8):
                    packed[v] = win_kv[b, kb * BKEY + r, g * 8 + v]
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(packed[0]), win_scale[b, kb * BKEY + r, g // 4],
                              T.address_of(vals[0]))
                for v in T.vectorized(8):
                    kv_s[r, g * 8 + v] = vals[v]
            for j in T.Parallel(BKEY):
                kp = win_pos[b, kb * BKEY + j]
                valid_s[j] = T.if_then_else((kp >= 0) and (kp <= p) and (kp > p - W), 1.0, 0.0)
        else:
            for i in T.serial(chunks):
                r = (i * threads + tx) // (D // 8)
                g = (i * threads + tx) % (D // 8)
                row = T.max(sel[bq_, kb * BKEY - W + r], 0)
                for v in T.vectorized(4):
                    packed[v] = cmp_kv[row, g * 4 + v]
                T.call_extern("handle", "di_dq_e2m1x8_e4m3", T.address_of(packed[0]), cmp_scale[row, g // 2],
                              T.address_of(vals[0]))
                for v in T.vectorized(8):
                    kv_s[r, g * 8 + v] = vals[v]
            for j in T.Parallel(BKEY):
                valid_s[j] = T.if_then_else(sel[bq_, kb * BKEY - W + j] >= 0, 1.0, 0.0)

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
    def body(bq, bs, q, sink, scale, out, o_part, ml_part, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv,
             cmp_scale, sel, kv, bias):
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
        packed = T.alloc_local((8,), "uint8")
        vals = T.alloc_local((8,), "bfloat16")
        tx = T.get_thread_binding()
        T.import_source(CUDA_SOURCE)

        for h, d in T.Parallel(H, D):
            q_s[h, d] = q[bq, h, fp4_perm(d) if source == "paged" else d]
        T.fill(m_f, NEG_INF)
        T.clear(l_f)
        T.clear(o_f)
        nb = n_blocks_static if source == "paged" else T.ceildiv(n_keys, BKEY)
        per = T.ceildiv(nb, splits)
        for it in T.serial(per):
            kb = bs * per + it
            if kb < nb:
                T.sync_threads()
                if source == "paged":
                    load_paged(bq, kb, kv_s, valid_s, packed, vals, tx, q_seq, q_pos, win_kv, win_scale, win_pos,
                               cmp_kv, cmp_scale, sel)
                else:
                    load_dense(bq, kb, kv_s, valid_s, kv, bias)
                T.sync_threads()
                T.gemm(q_s, kv_s, s_f, transpose_B=True, clear_accum=True)
                for h, j in T.Parallel(H, BKEY):
                    if source == "paged":
                        s_f[h, j] = T.if_then_else(valid_s[j] > 0, s_f[h, j] * scale, NEG_INF)
                    else:
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
                out[bq, h, fp4_perm(d) if source == "paged" else d] = T.cast(o_f[h, d] * rowsum[h], "bfloat16")
        else:
            for h, d in T.Parallel(H, D):
                o_part[bq, bs, h, d] = o_f[h, d]
            for h in T.Parallel(H):
                ml_part[bq, bs, 0, h] = m_f[h]
                ml_part[bq, bs, 1, h] = l_f[h]

    parts_o = (n_q, splits, H, D)
    parts_ml = (n_q, splits, 2, H)

    if source == "paged":

        @T.prim_func
        def sink_attention_paged(
            q: T.Tensor((n_q, H, D), "bfloat16"),
            q_seq: T.Tensor((n_q,), "int32"),
            q_pos: T.Tensor((n_q,), "int32"),
            win_kv: T.Tensor((n_seq, W, D), "uint8"),
            win_scale: T.Tensor((n_seq, W, D // 32), "uint8"),
            win_pos: T.Tensor((n_seq, W), "int32"),
            cmp_kv: T.Tensor((n_pool, D // 2), "uint8"),
            cmp_scale: T.Tensor((n_pool, D // 16), "uint8"),
            sel: T.Tensor((n_q, topk), "int32"),
            sink: T.Tensor((H,), "float32"),
            out: T.Tensor((n_q, H, D), "bfloat16"),
            o_part: T.Tensor(parts_o, "float32"),
            ml_part: T.Tensor(parts_ml, "float32"),
            scale: T.float32,
        ):
            with T.Kernel(splits, n_q, threads=threads) as (bs, bq):
                body(bq, bs, q, sink, scale, out, o_part, ml_part, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv,
                     cmp_scale, sel, None, None)

        return sink_attention_paged

    @T.prim_func
    def sink_attention_dense(
        q: T.Tensor((n_q, H, D), "bfloat16"),
        kv: T.Tensor((n_q, n_keys, D), "bfloat16"),
        bias: T.Tensor((n_q, n_keys), "float32"),
        sink: T.Tensor((H,), "float32"),
        out: T.Tensor((n_q, H, D), "bfloat16"),
        o_part: T.Tensor(parts_o, "float32"),
        ml_part: T.Tensor(parts_ml, "float32"),
        scale: T.float32,
    ):
        with T.Kernel(splits, n_q, threads=threads) as (bs, bq):
            body(bq, bs, q, sink, scale, out, o_part, ml_part, None, None, None, None, None, None, None, None, kv,
                 bias)

    return sink_attention_dense


def build_sink_combine(heads: int = 64, dim: int = 512, splits: int = 2, permuted: bool = True,
                       threads: int = 128):
    """out[q, h, :] = sum_i O_i e^(m_i - M) / (sum_i l_i e^(m_i - M) + e^(sink_h - M)), M = max(m_i, sink_h)."""
    H, D, S = heads, dim, splits
    n_q = T.dynamic("n_q")

    @T.prim_func
    def sink_combine(
        o_part: T.Tensor((n_q, S, H, D), "float32"),
        ml_part: T.Tensor((n_q, S, 2, H), "float32"),
        sink: T.Tensor((H,), "float32"),
        out: T.Tensor((n_q, H, D), "bfloat16"),
    ):
        with T.Kernel(H, n_q, threads=threads) as (h, bq):
            m_all = T.alloc_var("float32", init=0.0)
            den = T.alloc_var("float32", init=0.0)
            m_all = sink[h]
            for i in T.serial(S):
                m_all = T.max(m_all, ml_part[bq, i, 0, h])
            den = T.exp(sink[h] - m_all)
            for i in T.serial(S):
                den = den + ml_part[bq, i, 1, h] * T.exp(ml_part[bq, i, 0, h] - m_all)
            acc = T.alloc_fragment((D,), "float32")
            T.clear(acc)
            for i in T.serial(S):
                for d in T.Parallel(D):
                    acc[d] += o_part[bq, i, h, d] * T.exp(ml_part[bq, i, 0, h] - m_all)
            for d in T.Parallel(D):
                out[bq, h, fp4_perm(d) if permuted else d] = T.cast(acc[d] / den, "bfloat16")

    return sink_combine
