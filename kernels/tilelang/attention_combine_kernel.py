"""Split-K combine of sink attention: each key split of attention_kernel (per-query slates) and
attention_decode_kernel (the caches as stored) writes un-normalised O with its running max m (natural log) and sum
l; this kernel merges the splits and applies the per-head sink, which joins the denominator only."""

import tilelang.language as T

from .dequant import fp4_perm


def build_sink_combine(heads: int = 64, dim: int = 512, splits: int = 2, permuted: bool = True,
                       threads: int = 128):
    """out[q, h, :] = sum_i O_i e^(m_i - M) / (sum_i l_i e^(m_i - M) + e^(sink_h - M)), M = max(m_i, sink_h), summed
    over the splits in index order. permuted: the partials hold the head dim in dequant.py's twiddled order (the
    decode kernel's), un-twiddled on the store."""
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
