"""Grouped expert GEMM for MoE over FP4 (e2m1, ue8m0 per row x 32) or FP8 (e4m3, ue8m0 per 32x32) weights,
dequantised in-kernel, for the decode shape (a handful of tokens per expert) and beyond.

Layout ("swap AB"): each block computes C^T[rows, tokens] = W_tile[rows, K] . X[tokens, K]^T so the wide weight
dimension fills the wgmma M side (64 rows) and the few tokens of an expert sit on the N side (block_t = 16..256).
Weights stream once per (slot, row tile); the dequant runs in registers (dequant.py) into a bf16 shared tile.

Work is described by "slots" (one per distinct expert in the batch, built by moe_prep.py): slot s covers
positions [start, start+count) of the expert-sorted assignment list; `rows[pos]` is the token of position pos.
Blocks of empty slots exit at once; a slot with more than block_t tokens loops over token chunks.

Epilogues:
  "swiglu": rows of the tile are [block_n/2 gate rows | block_n/2 up rows] (weights packed tile-interleaved by
            moe_pack.py); out[pos, n] = bf16(silu(min(g, L)) * clamp(u, +-L) * aw[pos]) with g, u rounded to bf16
            first, as the torch reference's bf16 F.linear does.
  "add":    y[rows[pos], n] += float(bf16(acc))  (fp32 atomics: a token's routed experts and the shared expert,
            which may run concurrently on another stream, sum into one zeroed fp32 buffer)
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE, fp4_perm, fp8_perm


def build_grouped_gemm(fmt: str, epilogue: str, n_experts: int, n_rows: int, k_dim: int, block_n: int = 64,
                       block_t: int = 16, block_k: int = 256, threads: int = 128, num_stages: int = 2,
                       gather: bool = True):
    """fmt: "fp4" (w [E, N, K/2] uint8, scale [E, N, K/32] uint8) or "fp8" (w [E, N, K] uint8 e4m3 bits,
    scale [E, N/32, K/32] uint8). X is [tokens, K] bf16 read at rows[pos] (gather) or at pos (not gather)."""
    assert fmt in ("fp4", "fp8") and epilogue in ("swiglu", "add")
    assert n_rows % block_n == 0 and k_dim % block_k == 0 and block_k % 32 == 0
    E, N, K, BN, BT, BK = n_experts, n_rows, k_dim, block_n, block_t, block_k
    per_byte = 2 if fmt == "fp4" else 1
    KP, BKP = K // per_byte, BK // per_byte
    if fmt == "fp4":
        s_shape, s_tile = (E, N, K // 32), (BN, BK // 32)
        perm, dq_fn, chunk = fp4_perm, "di_dq_e2m1x8", 8
    else:
        assert BN % 32 == 0
        s_shape, s_tile = (E, N // 32, K // 32), (BN // 32, BK // 32)
        perm, dq_fn, chunk = fp8_perm, "di_dq_e4m3x8", 8
    chunks_per_row = BK // chunk
    dq_iters = BN * chunks_per_row // threads
    assert BN * chunks_per_row % threads == 0
    n_out = N // 2 if epilogue == "swiglu" else N
    x_iters = BT * BK // 8 // threads
    assert BT * BK // 8 % threads == 0
    half = BN // 2

    # x rows, assignment positions, slots and output rows vary independently (x of the down pass is h)
    n_x, n_pos, n_slots, n_y = T.dynamic("n_x"), T.dynamic("n_pos"), T.dynamic("n_slots"), T.dynamic("n_y")
    out_dtype = "bfloat16" if epilogue == "swiglu" else "float32"
    out_rows = n_pos if epilogue == "swiglu" else n_y

    @T.prim_func
    def grouped_gemm(
        x: T.Tensor((n_x, K), "bfloat16"),
        rows: T.Tensor((n_pos,), "int32"),
        aw: T.Tensor((n_pos,), "float32"),
        slot_expert: T.Tensor((n_slots,), "int32"),
        slot_start: T.Tensor((n_slots,), "int32"),
        slot_count: T.Tensor((n_slots,), "int32"),
        w: T.Tensor((E, N, KP), "uint8"),
        ws: T.Tensor(s_shape, "uint8"),
        out: T.Tensor((out_rows, n_out), out_dtype),
        limit: T.float32,
    ):
        with T.Kernel(N // BN, n_slots, threads=threads) as (bx, by):
            w_s = T.alloc_shared((BN, BKP), "uint8")
            sc_s = T.alloc_shared(s_tile, "uint8")
            wd_s = T.alloc_shared((BN, BK), "bfloat16")
            x_s = T.alloc_shared((BT, BK), "bfloat16")
            acc = T.alloc_fragment((BN, BT), "float32")
            c_s = T.alloc_shared((BN, BT), "float32")
            row_s = T.alloc_shared((BT,), "int32")
            packed = T.alloc_local((chunk // per_byte,), "uint8")
            vals = T.alloc_local((chunk,), "bfloat16")
            xv = T.alloc_local((8,), "bfloat16")
            tx = T.get_thread_binding()
            T.import_source(CUDA_SOURCE)

            e = slot_expert[by]
            cnt = slot_count[by]
            start = slot_start[by]
            for c in T.serial(T.ceildiv(cnt, BT)):
                for j in T.Parallel(BT):
                    if gather:
                        row_s[j] = T.if_then_else(c * BT + j < cnt, rows[T.min(start + c * BT + j, n_pos - 1)], -1)
                    else:
                        row_s[j] = T.if_then_else(c * BT + j < cnt, start + c * BT + j, -1)
                T.clear(acc)
                for k in T.Pipelined(K // BK, num_stages=num_stages):
                    T.copy(w[e, bx * BN, k * BKP], w_s)
                    if fmt == "fp4":
                        T.copy(ws[e, bx * BN, k * (BK // 32)], sc_s)
                    else:
                        T.copy(ws[e, bx * (BN // 32), k * (BK // 32)], sc_s)
                    # activations: one 16-byte load per 8 channels, permuted in registers to the dequant order
                    for it in T.unroll(x_iters):
                        xi = (it * threads + tx) // (BK // 8)
                        xg = (it * threads + tx) % (BK // 8)
                        if row_s[xi] >= 0:
                            for v in T.vectorized(8):
                                xv[v] = x[row_s[xi], k * BK + xg * 8 + v]
                        else:
                            for v in T.vectorized(8):
                                xv[v] = T.cast(0, "bfloat16")
                        for v in T.unroll(8):
                            x_s[xi, xg * 8 + v] = xv[perm(v)]
                    # unrolled: shared-memory addresses become base + constant (the loop is issue-bound)
                    for it in T.unroll(dq_iters):
                        r = (it * threads + tx) // chunks_per_row
                        g = (it * threads + tx) % chunks_per_row
                        for v in T.vectorized(chunk // per_byte):
                            packed[v] = w_s[r, g * (chunk // per_byte) + v]
                        if fmt == "fp4":
                            sbyte = sc_s[r, g * chunk // 32]
                        else:
                            sbyte = sc_s[r // 32, g * chunk // 32]
                        T.call_extern("handle", dq_fn, T.address_of(packed[0]), sbyte, T.address_of(vals[0]))
                        for v in T.vectorized(chunk):
                            wd_s[r, g * chunk + v] = vals[v]
                    T.gemm(wd_s, x_s, acc, transpose_B=True)
                T.copy(acc, c_s)
                if epilogue == "swiglu":
                    for i, j in T.Parallel(half, BT):
                        if row_s[j] >= 0:
                            g_ = T.cast(T.cast(c_s[i, j], "bfloat16"), "float32")
                            u_ = T.cast(T.cast(c_s[half + i, j], "bfloat16"), "float32")
                            g_ = T.if_then_else(limit > 0, T.min(g_, limit), g_)
                            u_ = T.if_then_else(limit > 0, T.max(T.min(u_, limit), -limit), u_)
                            pos = start + c * BT + j
                            out[pos, bx * half + i] = T.cast(g_ * T.sigmoid(g_) * u_ * aw[pos], "bfloat16")
                else:
                    for i, j in T.Parallel(BN, BT):
                        if row_s[j] >= 0:
                            dst = rows[start + c * BT + j]
                            T.atomic_add(out[dst, bx * BN + i], T.cast(T.cast(c_s[i, j], "bfloat16"), "float32"))

    return grouped_gemm
