"""Weight-only FP8 GEMM for bf16 activations: y[m, n] = sum_k x[m, k] * W[n, k], W stored as e4m3 codes with one
ue8m0 scale per 32x32 block (kernels/fp8_weight.py), dequantised in registers to bf16 and fed to wgmma as the A
operand; fp32 accumulation; the activations stay bf16, so the result equals the bf16 GEMM on the dequantised
matrix up to the order of the fp32 sums.

Device code is the MoE v3 kernel's (moe_kernel.py, measured on the H200: 67-70% of copy bandwidth for the routed
FP4 experts): the same cp.async stage layout, FP8 dequantisation straight into the wgmma A fragments
(`di3_group<1,...>`), in-place activation permute and one barrier per K step. What differs is the work
description: one weight matrix, no routing table, and the tokens tiled over the grid:

    grid (ceil(M / BT), N / BN, k_splits); block (bm, bn, bz) computes rows bn*BN.. of W (BN = 64: one
    warpgroup; 128: two, sharing the activation tile) against tokens bm*BT.. over K steps [bz*NK, (bz+1)*NK).
    blockIdx.x is the token tile, so the blocks that read one weight tile run side by side and all but the first
    find it in L2.

Output: k_splits == 1 writes bf16 directly; k_splits > 1 writes each split's unrounded fp32 partial to
part[bz, m, n], and the last of a tile's k_splits blocks to finish (an arrival counter per output tile) adds them in
split order (0, 1, ...), rounds once and writes bf16 (`fused_reduce`; without it `build_split_reduce`, a second
launch, does the same sums). Which block is last changes nothing but who adds: the order of the sums is fixed, so
the result is deterministic and the same bits either way. The counter is reset by the block that read it, so
the next launch (stream-ordered; under PDL its griddepcontrol.wait is the whole previous grid) finds it zero.

Batch invariance: the tile shape, the K split and the reduction order are fixed by (N, K) alone, never by M, and
a token's MMA column depends only on its own activations (columns of tokens beyond M are never loaded, their
garbage never stored). So row i of the output is bitwise the same whatever M is and whichever tile row i lands
in.
"""

import tilelang.language as T

from .counters import LD_CG_SOURCE, count_in
from .moe_kernel import (BLOCK_N, CS_PAD, cuda_source, k_loop_macro, load_roles, shared_bytes, smem_layout,
                         stage_macros)

BLOCK_T = 32  # tokens per tile (the wgmma N): M <= 32 reads each weight once from HBM
BLOCK_K = 128  # K per pipeline step: 8 KB of FP8 weights + 8 KB of activations per stage
STAGES = 4  # the MoE kernel's loop is ordered for 4 (the activation threads' proxy fence has no cp.async to wait on)


def build_fp8_linear(n_rows: int, k_dim: int, k_splits: int = 1, block_t: int = BLOCK_T, block_k: int = BLOCK_K,
                     num_stages: int = STAGES, min_blocks: int = 0, groups: int = 1, block_n: int = BLOCK_N,
                     fused_reduce: int = 0):
    """x [m, K] bf16, w [N, K] uint8 (e4m3), ws [N/32, K/32] uint8 (ue8m0) -> out [m, N] bf16 (k_splits == 1) or
    part [k_splits, m, N] fp32. m is symbolic: one compiled kernel serves every batch size.

    fused_reduce = C > 0 (with k_splits > 1): the arguments are (x, w, ws, part, out, counters [C] int32 all zero),
    and the last block of each output tile sums the partials into out (counters.count_in); tile (bm, bn) uses
    counters[bm * N / BN + bn], so the launcher keeps ceil(m / block_t) * N / block_n <= C.

    groups > 1 (the grouped output projection in one launch): x [m, groups * K], and row group g of W (rows
    [g * N / groups, (g + 1) * N / groups)) multiplies x's columns [g * K, (g + 1) * K): a block's group follows
    from its weight tile, so only the activation columns it loads move.

    block_n 64 (one warpgroup) or 128 (two warpgroups, 256 threads, each its own 64 weight rows against the one
    activation tile, as the MoE kernel's): a token's result is the same bits at every block_t and block_n (its
    K loop and MMA column do not change), so tiles may follow M."""
    assert block_t in (8, 16, 32, 64) and block_k in (128, 256, 512) and num_stages >= 4
    assert block_n in (64, 128)
    assert n_rows % (block_n * groups) == 0 and k_dim % (block_k * k_splits) == 0
    BN, TH = block_n, 2 * block_n      # a warpgroup per 64 weight rows (the wgmma M)
    tiles_per_group = n_rows // groups // BN
    N, K, BT, BK, S = n_rows, k_dim, block_t, block_k, num_stages
    NG = BK // 64                      # 64-K groups per step
    NK = K // BK // k_splits           # steps per block
    STAGE, OFF_S, OFF_X, BKP, SCB = smem_layout("fp8", BT, BK, BN)
    CPR = BKP // 16                    # 16-byte weight chunks per row and step
    TW, _ = load_roles(TH)       # the first half loads weights, the second activations (moe_kernel)
    W_IT = BN * CPR // TW
    CS_LD = BN + CS_PAD
    partial = k_splits > 1
    fused = partial and fused_reduce > 0
    C = max(fused_reduce, 1)
    if min_blocks == 0:
        min_blocks = max(1, min(4, (227 * 1024) // (shared_bytes("fp8", BT, BK, S, BN) + 1024)))
    src = cuda_source(BT) + (LD_CG_SOURCE if fused else "")  # one import_source per kernel

    load_x, permute, group = stage_macros("fp8", BT, BK, TH)
    m = T.dynamic("m")
    out_shape = (k_splits, m, N) if partial else (m, N)
    out_dtype = "float32" if partial else "bfloat16"

    @T.macro
    def issue(smem, xr, x, w, ws, bn, _, tx, kk, slot):  # (p, q) = (bn, unused): k_loop_macro's call
        # one stage (global K step kk) into slot: weights (16-byte chunks XOR-swizzled as di3_group reads them),
        # the tile's 32-row scale rows, the token rows of the activations
        base = slot * STAGE
        if tx < TW:
            for it in T.unroll(W_IT):
                r = (it * TW + tx) // CPR
                cc = (it * TW + tx) % CPR
                cs = (cc // 8) * 8 + T.bitwise_xor(cc % 8, 4 * (r % 2))
                T.call_extern("handle", "di3_cp16", T.address_of(smem[(base + r * BKP + cs * 16) // 4]),
                              T.address_of(w[bn * BN + r, kk * BKP + cc * 16]), 1)
        if tx < BN // 32:
            T.call_extern("handle", f"di3_cp_small<{SCB}>", T.address_of(smem[(base + OFF_S + tx * SCB) // 4]),
                          T.address_of(ws[bn * (BN // 32) + tx, kk * SCB]), 1)
        # tokens past M (xr < 0) are zero-filled; a grouped weight tile reads its group's K columns of x
        load_x(smem, xr, x, tx, kk if groups == 1 else kk + (bn // tiles_per_group) * (K // BK), base)

    k_loop = k_loop_macro(S, NK, NG, BT, issue, permute, group, TW)

    @T.macro
    def body(x, w, ws, out, bm, bn, bz):
        T.annotate_min_blocks_per_sm(min_blocks)
        smem = T.alloc_shared((S * STAGE // 4,), "uint32")  # stage slots as 32-bit words (see moe_kernel.py)
        c_s = T.alloc_shared((BT, CS_LD), "float32")
        a = T.alloc_local((32,), "uint32")       # two A buffers of 16 registers
        acc = T.alloc_local((BT // 2,), "float32")
        xr = T.alloc_var("int32", init=-1)
        tx = T.get_thread_binding()
        T.import_source(src)

        k_first = bz * NK
        for i in T.unroll(BT // 2):
            acc[i] = T.float32(0)
        xr = T.if_then_else(bm * BT + tx % BT < m, bm * BT + tx % BT, -1)
        k_loop(smem, a, acc, c_s, xr, x, w, ws, bn, 0, tx, k_first)
        T.sync_threads()
        # consecutive threads write consecutive output columns (weight rows)
        for it in T.unroll(BN * BT // TH):
            j = (it * TH + tx) // BN
            i = (it * TH + tx) % BN
            if bm * BT + j < m:
                if partial:
                    out[bz, bm * BT + j, bn * BN + i] = c_s[j, i]
                else:
                    out[bm * BT + j, bn * BN + i] = T.cast(c_s[j, i], "bfloat16")

    if not fused:
        @T.prim_func
        def fp8_linear(
            x: T.Tensor((m, groups * K), "bfloat16"),
            w: T.Tensor((N, K), "uint8"),
            ws: T.Tensor((N // 32, K // 32), "uint8"),
            out: T.Tensor(out_shape, out_dtype),
        ):
            with T.Kernel(T.ceildiv(m, BT), N // BN, k_splits, threads=TH) as (bm, bn, bz):
                body(x, w, ws, out, bm, bn, bz)

        return fp8_linear

    @T.prim_func
    def fp8_linear_fused(
        x: T.Tensor((m, groups * K), "bfloat16"),
        w: T.Tensor((N, K), "uint8"),
        ws: T.Tensor((N // 32, K // 32), "uint8"),
        part: T.Tensor((k_splits, m, N), "float32"),
        out: T.Tensor((m, N), "bfloat16"),
        counters: T.Tensor((C,), "int32"),
    ):
        with T.Kernel(T.ceildiv(m, BT), N // BN, k_splits, threads=TH) as (bm, bn, bz):
            body(x, w, ws, part, bm, bn, bz)
            arrived = T.alloc_shared((1,), "int32")
            total = T.alloc_var("float32", init=0)
            tx = T.get_thread_binding()
            count_in(counters, bm * (N // BN) + bn, arrived, tx)
            if arrived[0] == k_splits - 1:
                T.call_extern("handle", "__threadfence")
                for it in T.unroll(BN * BT // TH):
                    j = (it * TH + tx) // BN
                    i = (it * TH + tx) % BN
                    if bm * BT + j < m:
                        total = T.float32(0)
                        for s in T.unroll(k_splits):  # split order, as build_split_reduce
                            total = total + T.call_extern("float32", "di_ld_cg",
                                                          T.address_of(part[s, bm * BT + j, bn * BN + i]))
                        out[bm * BT + j, bn * BN + i] = T.cast(total, "bfloat16")
                if tx == 0:
                    counters[bm * (N // BN) + bn] = 0

    return fp8_linear_fused


REDUCE_THREADS = 64  # one thread per output column of a 64-wide tile (N is a multiple of 64)


def build_split_reduce(n_rows: int, k_splits: int):
    """part [k_splits, m, N] fp32 -> out [m, N] bf16: each element summed in split order from 0, rounded once."""
    N = n_rows
    assert N % REDUCE_THREADS == 0
    m = T.dynamic("m")

    @T.prim_func
    def split_reduce(part: T.Tensor((k_splits, m, N), "float32"), out: T.Tensor((m, N), "bfloat16")):
        with T.Kernel(N // REDUCE_THREADS, m, threads=REDUCE_THREADS) as (bn, row):
            tx = T.get_thread_binding()
            acc = T.alloc_var("float32", init=0)
            for s in T.unroll(k_splits):
                acc = acc + part[s, row, bn * REDUCE_THREADS + tx]
            out[row, bn * REDUCE_THREADS + tx] = T.cast(acc, "bfloat16")

    return split_reduce
