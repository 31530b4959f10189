"""The compressor's pooling step (`compressor_pool`): kv, gate [G, ratio, D] fp32 -> [G, D] fp32, per group and
channel a softmax of the gates over the group's `ratio` tokens, then the gate-weighted sum of the kv rows. The group
count is symbolic: one compiled kernel per (ratio, D) serves every step.

One thread owns 4 adjacent channels of one group (16-byte loads and stores). The roundings are the torch op's
(deepinfer.kernels.torch.compressor on CUDA), step for step:
* softmax as ATen's spatial softmax (a non-last dim): max over the tokens starting from fp32 lowest, the sum of
  expf(g - max) in token order, each weight expf(g - max) / sum (IEEE division; accurate expf, no fast math);
* the products kv * p rounded before the sum (`__fmul_rn`: nvcc would otherwise fuse them into an fma);
* the sum over the tokens in ATen's order for a reduction along a strided dim: four accumulators, token j into
  accumulator j % 4, combined ((a0 + a1) + a2) + a3 (for ratio <= 4 that is the plain left-to-right sum).
Every thread's work is fixed by its (group, channels): no result depends on the batch.
"""

import numpy as np
import tilelang.language as T

F32 = "float32"
MAX_RATIO = 16  # the token loop is unrolled (V4.1-Flash pools pairs; V4 groups of 4 fit too)
LOWEST = float(np.finfo(np.float32).min)  # ATen's at::numeric_limits<float>::lowest(), the max's start


def build_compressor_pool(ratio: int, dim: int, threads: int = 256):
    assert 1 <= ratio <= MAX_RATIO and dim % 4 == 0 and dim > 0
    NV = dim // 4
    groups = T.dynamic("groups")

    @T.prim_func
    def compressor_pool(
        kv: T.Tensor((groups, ratio, dim), F32),
        gate: T.Tensor((groups, ratio, dim), F32),
        out: T.Tensor((groups, dim), F32),
    ):
        with T.Kernel(T.ceildiv(groups * NV, threads), threads=threads) as b:
            tx = T.get_thread_binding()
            gr = T.alloc_local((4,), F32)
            kr = T.alloc_local((4,), F32)
            m = T.alloc_local((4,), F32)
            s = T.alloc_local((4,), F32)
            acc = T.alloc_local((16,), F32)  # [accumulator j % 4][channel]
            o = T.alloc_local((4,), F32)
            c = b * threads + tx
            if c < groups * NV:
                g = c // NV
                d = (c % NV) * 4
                for i in T.unroll(4):
                    m[i] = T.float32(LOWEST)
                    s[i] = T.float32(0.0)
                for u in T.unroll(16):
                    acc[u] = T.float32(0.0)
                for j in T.unroll(ratio):
                    for i in T.vectorized(4):
                        gr[i] = gate[g, j, d + i]
                    for i in T.unroll(4):
                        m[i] = T.max(m[i], gr[i])
                for j in T.unroll(ratio):
                    for i in T.vectorized(4):
                        gr[i] = gate[g, j, d + i]
                    for i in T.unroll(4):
                        s[i] = s[i] + T.exp(gr[i] - m[i])
                for j in T.unroll(ratio):
                    for i in T.vectorized(4):
                        gr[i] = gate[g, j, d + i]
                    for i in T.vectorized(4):
                        kr[i] = kv[g, j, d + i]
                    for i in T.unroll(4):
                        acc[(j % 4) * 4 + i] = acc[(j % 4) * 4 + i] + T.ieee_mul(kr[i], T.exp(gr[i] - m[i]) / s[i])
                for i in T.unroll(4):
                    o[i] = ((acc[i] + acc[4 + i]) + acc[8 + i]) + acc[12 + i]
                for i in T.vectorized(4):
                    out[g, d + i] = o[i]

    return compressor_pool
