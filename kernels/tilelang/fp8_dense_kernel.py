"""An FP8 block weight (e4m3 codes, one ue8m0 scale per 32x32 block; kernels/fp8_weight.py) as a dense bf16
matrix, in one pass: each thread reads 16 codes (one 16-byte load) and their block's scale byte and writes 16 bf16
values (two 16-byte stores), 3 bytes of traffic per weight.

Why: from linear.DENSE_ROWS rows the projections multiply the dequantised weight with cuBLAS, and the two
element-wise torch passes this replaces (codes to bf16, then times the broadcast scale: ~7 bytes a weight, the
broadcast at a fraction of the copy rate) cost ~0.3 ms for `wq_b`, as much as the GEMM they fed at 256 rows
(benchmarks/results/prefill_kernels_linear_bt_h200.log).

Exact, as Fp8BlockWeight.dense: e4m3 to f16 by the hardware's cvt (every e4m3 value, subnormals included, is an
f16 value), to fp32, times 2^(s-127) (a power of two: exact), rounded to bf16 (exact: 4 significant bits).
"""

import tilelang.language as T

from .dequant import ue8m0_scale

VEC = 16  # codes per thread: one 16-byte load
THREADS = 256


def build_fp8_dense(n_rows: int, k_dim: int):
    """w [N, K] float8_e4m3 (Fp8BlockWeight.weight viewed as torch.float8_e4m3fn), ws [N/32, K/32] uint8 (ue8m0)
    -> out [N, K] bf16."""
    N, K = n_rows, k_dim
    assert N % 32 == 0 and K % 32 == 0
    CPR = K // VEC  # 16-code chunks per row
    chunks = N * CPR

    @T.prim_func
    def fp8_dense(
        w: T.Tensor((N, K), "float8_e4m3"),
        ws: T.Tensor((N // 32, K // 32), "uint8"),
        out: T.Tensor((N, K), "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(chunks, THREADS), threads=THREADS) as b:
            tx = T.get_thread_binding()
            wl = T.alloc_local((VEC,), "float8_e4m3")
            wh = T.alloc_local((VEC,), "float16")
            yl = T.alloc_local((VEC,), "bfloat16")
            c = b * THREADS + tx
            if c < chunks:
                row = c // CPR
                col = (c % CPR) * VEC
                for v in T.vectorized(VEC):
                    wl[v] = w[row, col + v]
                s = T.cast(ws[row // 32, col // 32], "int32")
                scale = ue8m0_scale(s)  # 2^(s-127)
                for v in T.vectorized(VEC):  # two codes an instruction (cvt e4m3x2 -> f16x2), exact
                    wh[v] = T.cast(wl[v], "float16")
                for v in T.unroll(VEC):
                    yl[v] = T.cast(T.cast(wh[v], "float32") * scale, "bfloat16")
                for v in T.vectorized(VEC):
                    out[row, col + v] = yl[v]

    return fp8_dense
