"""Engram kernels: the n-gram hash (`engram_hash`) and the gated add (`engram_gate`). Token counts are symbolic: one
compiled kernel per model width serves every step.

Hash: one thread per output id (token t, Engram layer l, column c = (n - 1) * heads-block + head): the rolling xor of
tokens[t, k] * multipliers[l, k] for k = 0..n (n-gram of n + 1 tokens), then modulo the column's prime and plus its
offset. Exact int64 arithmetic as torch's: the products and the offset add wrap modulo 2^64 (done in uint64, where
C++ defines the wrap), `%` is torch's remainder (Python's: the sign of the divisor), from C's truncating `%` plus
the divisor where the signs differ.

Gate: one block per (token, stream), 256 threads. Per thread the sums of h^2, key^2 and h * w * key over its
4-wide vectors in a fixed order, then xor shuffles in each warp and the warps' partials added in warp order: the
reduction order depends on the width only, so a token's output is bitwise the same whatever the batch (the
batch-invariant mode can use it as it is). The scalar steps follow the torch op's roundings (mean as sum * fp32(1/D),
rsqrtf, `* fp32(D ** -0.5)`, clamp at fp32(1e-6), sqrtf, copysign, 1 / (1 + expf(-x))); the sums' order is not
ATen's, so the result is close to the torch op, not bitwise.
"""

import numpy as np
import tilelang.language as T

from .rowwise_kernel import f32

I64, U64, BF16, F32 = "int64", "uint64", "bfloat16", "float32"
GATE_DTYPES = (BF16, F32)


def _wrap_mul(a, b):
    return T.cast(T.cast(a, U64) * T.cast(b, U64), I64)


def _wrap_add(a, b):
    return T.cast(T.cast(a, U64) + T.cast(b, U64), I64)


def build_engram_hash(ngram: int, layers: int, heads: int, threads: int = 256):
    """tokens [T, ngram] int64, multipliers [layers, ngram], primes [layers, ngram - 1, heads], offsets [layers, C]
    -> ids [T, layers, C], C = (ngram - 1) * heads."""
    assert ngram >= 2 and layers >= 1 and heads >= 1
    C = (ngram - 1) * heads
    PER_TOK = layers * C
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def engram_hash(
        tokens: T.Tensor((n_tok, ngram), I64),
        mult: T.Tensor((layers, ngram), I64),
        primes: T.Tensor((layers, ngram - 1, heads), I64),
        offsets: T.Tensor((layers, C), I64),
        out: T.Tensor((n_tok, layers, C), I64),
    ):
        with T.Kernel(T.ceildiv(n_tok * PER_TOK, threads), threads=threads) as b:
            tx = T.get_thread_binding()
            roll = T.alloc_var(I64)
            p = T.alloc_var(I64)
            r = T.alloc_var(I64)
            e = b * threads + tx
            if e < n_tok * PER_TOK:
                t = e // PER_TOK
                l = (e % PER_TOK) // C
                c = e % C
                n = c // heads + 1  # this column hashes the n-gram of tokens 0..n (looking back)
                roll = _wrap_mul(tokens[t, 0], mult[l, 0])
                for k in T.unroll(ngram - 1):
                    if k + 1 <= n:
                        roll = roll ^ _wrap_mul(tokens[t, k + 1], mult[l, k + 1])
                p = primes[l, n - 1, c % heads]
                r = T.truncmod(roll, p)
                r = r + T.if_then_else((r != T.int64(0)) & ((r < T.int64(0)) != (p < T.int64(0))), p, T.int64(0))
                out[t, l, c] = _wrap_add(r, offsets[l, c])

    return engram_hash


def build_engram_gate(hc: int, dim: int, key_dtype: str = F32, value_dtype: str = BF16, weight_dtype: str = F32,
                      threads: int = 256):
    """streams [T, hc, dim] bf16, key [T, hc, dim], value [T, dim], weight [hc, dim] -> out [T, hc, dim] bf16:
    out = bf16(h + sigmoid(signed_sqrt(<h, w * key> * rstd(h) * rstd(key) / sqrt(dim))) * value), h = streams."""
    assert dim % 4 == 0 and dim > 0 and hc >= 1 and threads % 32 == 0
    assert key_dtype in GATE_DTYPES and value_dtype in GATE_DTYPES and weight_dtype in GATE_DTYPES
    NV = dim // 4
    PER = -(-NV // threads)  # 4-wide vectors per thread (5 at D = 5120)
    WARPS = threads // 32
    factor = float(np.float32(1) / np.float32(dim))  # ATen's mean: the sum times fp32(1 / numel per output)
    scale = f32(dim ** -0.5)
    floor = f32(1e-6)
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def engram_gate(
        streams: T.Tensor((n_tok, hc, dim), BF16),
        key: T.Tensor((n_tok, hc, dim), key_dtype),
        value: T.Tensor((n_tok, dim), value_dtype),
        weight: T.Tensor((hc, dim), weight_dtype),
        out: T.Tensor((n_tok, hc, dim), BF16),
        eps: T.float32,
    ):
        with T.Kernel(n_tok * hc, threads=threads) as b:
            tx = T.get_thread_binding()
            t = b // hc
            k = b % hc
            xr = T.alloc_local((PER * 4,), BF16)  # the stream's values, kept for the output pass
            kr = T.alloc_local((4,), key_dtype)
            wr = T.alloc_local((4,), weight_dtype)
            vr = T.alloc_local((4,), value_dtype)
            o = T.alloc_local((4,), BF16)
            acc = T.alloc_local((3,), F32)  # sum h^2, sum key^2, sum h * w * key
            tot = T.alloc_local((3,), F32)
            gate = T.alloc_local((1,), F32)
            red = T.alloc_shared((3, WARPS), F32)
            for i in T.unroll(3):
                acc[i] = T.float32(0.0)
            for m in T.unroll(PER):
                v = m * threads + tx
                if v < NV:
                    for i in T.vectorized(4):
                        xr[m * 4 + i] = streams[t, k, v * 4 + i]
                    for i in T.vectorized(4):
                        kr[i] = key[t, k, v * 4 + i]
                    for i in T.vectorized(4):
                        wr[i] = weight[k, v * 4 + i]
                    for i in T.unroll(4):
                        hv = T.cast(xr[m * 4 + i], F32)
                        kv = T.cast(kr[i], F32)
                        acc[0] = acc[0] + T.ieee_mul(hv, hv)
                        acc[1] = acc[1] + T.ieee_mul(kv, kv)
                        acc[2] = acc[2] + T.ieee_mul(T.ieee_mul(hv, T.cast(wr[i], F32)), kv)
            for i in T.unroll(3):
                for s in T.unroll(5):  # xor butterfly: every lane ends with the same warp sum
                    acc[i] = acc[i] + T.shfl_xor(acc[i], 16 >> s)
            if tx % 32 == 0:
                for i in T.unroll(3):
                    red[i, tx // 32] = acc[i]
            T.sync_threads()
            for i in T.unroll(3):
                tot[i] = red[i, 0]
                for w in T.unroll(WARPS - 1):
                    tot[i] = tot[i] + red[i, w + 1]
            rstd = T.ieee_mul(T.rsqrt(T.ieee_add(T.ieee_mul(tot[0], T.float32(factor)), eps)),
                              T.rsqrt(T.ieee_add(T.ieee_mul(tot[1], T.float32(factor)), eps)))
            dot = T.ieee_mul(T.ieee_mul(tot[2], rstd), T.float32(scale))
            gate[0] = T.sigmoid(T.copysign(T.sqrt(T.max(T.abs(dot), T.float32(floor))), dot))
            for m in T.unroll(PER):
                v = m * threads + tx
                if v < NV:
                    for i in T.vectorized(4):
                        vr[i] = value[t, v * 4 + i]
                    for i in T.unroll(4):
                        o[i] = T.cast(T.ieee_add(T.cast(xr[m * 4 + i], F32), T.ieee_mul(gate[0], T.cast(vr[i], F32))),
                                      BF16)
                    for i in T.vectorized(4):
                        out[t, k, v * 4 + i] = o[i]

    return engram_gate
