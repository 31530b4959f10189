"""Grouped GEMM over FP4 experts as stored, for prefill-sized token counts: out[rows, :] = a[rows, :] . W_e^T for
every tile of `block_m` rows, e the tile's expert. The FP4 tile of W_e is brought into shared memory as stored
(0.53 bytes a weight), dequantised there to bf16 by all threads (dequant.py's bit placement: a few integer ops and
one bf16x2 multiply per pair) and fed to wgmma from shared memory next to the activation tile.

Why beside the streaming kernel (moe_kernel.py): that one puts the weights on the wgmma M side and at most 64
tokens on N, which is right when an expert sees a few tokens (decode: the weights are read once). At a prefill
step's hundreds of tokens per expert the cost is the MMA itself, and here each dequantised weight feeds a
`block_m`-token tile of a block_m x 256 output tile. The previous prefill path dequantised every expert to bf16
in global memory first (2.5 bytes a weight written and read back: 15 ms a layer at V4.1-Flash shapes, more than
its grouped GEMM); this kernel never writes a dequantised weight outside shared memory. On an H200 with full
128-row tiles: 334 TFLOP/s for gate/up, 367 for down (44% / 48% of the bf16 GEMM rate measured beside it;
benchmarks/results/prefill_kernels_gpu_h200.json). moe_prefill.py runs it with 64-row tiles, which pad an
expert's rows less (faster at 2K-16K tokens per call there).

K order: di_dq_e2m1x8 yields each 8 codes in the order [0,4,1,5,2,6,3,7] (`fp4_perm`), so `a` must hold its K
columns in that order too (the caller permutes the activations once; the SwiGLU epilogue writes its output
permuted, ready to be the down projection's `a`). The dot products are unchanged.

Rows: `a` holds each expert's rows contiguously, padded to whole tiles (zero rows; `tile_expert[t]` names tile t's
expert). Epilogues:
  "plain":  out[r, n] = bf16(acc)                                         (out [rows, n])
  "swiglu": W rows are the packed [32 gate | 32 up] halves of each 64 (PackedExperts' interleave); with g, u the
            accumulators rounded to bf16 (the torch reference's bf16 GEMM output), out[r, c] = bf16(silu(min(g, L))
            * clamp(u, +-L) * aw[r]) for the c-th gate/up pair, written at K position fp4_perm^-1 (out [rows, n/2]).
Scale bytes S must be <= 128 (di_dq_e2m1x8's limit; checkpoints' FP4 experts sit near S = 120).
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE, fp4_perm

HALF = 32  # gate (or up) rows per 64-row group of the packed w13


def build_fp4_expert_gemm(n: int, k: int, epilogue: str, block_m: int = 64, block_n: int = 256,
                          block_k: int = 64, stages: int = 2, threads: int = 256):
    """prim_func(a [rows, k] bf16 (K permuted), tile_expert [tiles] int32, w [E, n, k/2] uint8, s [E, n, k/32]
    uint8, aw [rows] fp32, out [rows, n | n/2] bf16, limit fp32); rows = tiles * block_m (the caller's promise),
    rows, tiles and E dynamic."""
    assert epilogue in ("plain", "swiglu")
    assert n % block_n == 0 and k % block_k == 0 and block_k % 32 == 0 and block_n % (2 * HALF) == 0
    units = block_n * block_k // 8  # 8 codes (4 bytes) per unit
    assert units % threads == 0
    n_out = n // 2 if epilogue == "swiglu" else n
    o_n = block_n // 2 if epilogue == "swiglu" else block_n
    rows, tiles, experts = T.dynamic("rows"), T.dynamic("tiles"), T.dynamic("experts")  # rows = tiles * block_m

    @T.prim_func
    def fp4_expert_gemm(
        a: T.Tensor((rows, k), "bfloat16"),
        tile_expert: T.Tensor((tiles,), "int32"),
        w: T.Tensor((experts, n, k // 2), "uint8"),
        s: T.Tensor((experts, n, k // 32), "uint8"),
        aw: T.Tensor((rows,), "float32"),
        out: T.Tensor((rows, n_out), "bfloat16"),
        limit: T.float32,
    ):
        with T.Kernel(n // block_n, tiles, threads=threads) as (bx, by):
            a_s = T.alloc_shared((block_m, block_k), "bfloat16")
            q_s = T.alloc_shared((block_n, block_k // 2), "uint8")
            s_s = T.alloc_shared((block_n, k // 32), "uint8")
            w_s = T.alloc_shared((block_n, block_k), "bfloat16")
            c_s = T.alloc_shared((block_m, block_n), "bfloat16")
            acc = T.alloc_fragment((block_m, block_n), "float32")
            packed = T.alloc_local((4,), "uint8")
            vals = T.alloc_local((8,), "bfloat16")
            e = T.alloc_local((1,), "int32")
            tx = T.get_thread_binding()
            T.import_source(CUDA_SOURCE)
            e[0] = tile_expert[by]
            T.copy(s[e[0], bx * block_n:(bx + 1) * block_n, 0:k // 32], s_s)
            T.clear(acc)
            for kk in T.Pipelined(k // block_k, num_stages=stages):
                T.copy(a[by * block_m:(by + 1) * block_m, kk * block_k:(kk + 1) * block_k], a_s)
                T.copy(w[e[0], bx * block_n:(bx + 1) * block_n, kk * (block_k // 2):(kk + 1) * (block_k // 2)], q_s)
                for i in T.serial(units // threads):
                    r = (i * threads + tx) // (block_k // 8)
                    g8 = (i * threads + tx) % (block_k // 8)
                    for v in T.vectorized(4):
                        packed[v] = q_s[r, g8 * 4 + v]
                    T.call_extern("handle", "di_dq_e2m1x8", T.address_of(packed[0]),
                                  s_s[r, (kk * block_k + g8 * 8) // 32], T.address_of(vals[0]))
                    for v in T.vectorized(8):
                        w_s[r, g8 * 8 + v] = vals[v]
                T.gemm(a_s, w_s, acc, transpose_B=True)
            T.copy(acc, c_s)  # rounded to bf16, as the reference's GEMM output
            if epilogue == "plain":
                T.copy(c_s, out[by * block_m:(by + 1) * block_m, bx * block_n:(bx + 1) * block_n])
            else:
                for i, j in T.Parallel(block_m, o_n):
                    c = fp4_perm(j)  # the pair written at K position j of the down projection's input
                    gate = T.cast(c_s[i, (c // HALF) * 2 * HALF + c % HALF], "float32")
                    up = T.cast(c_s[i, (c // HALF) * 2 * HALF + HALF + c % HALF], "float32")
                    gate = T.if_then_else(limit > 0, T.min(gate, limit), gate)
                    up = T.if_then_else(limit > 0, T.max(T.min(up, limit), -limit), up)
                    act = gate / (1.0 + T.exp(-gate)) * up
                    out[by * block_m + i, bx * o_n + j] = T.cast(act * aw[by * block_m + i], "bfloat16")

    return fp4_expert_gemm
