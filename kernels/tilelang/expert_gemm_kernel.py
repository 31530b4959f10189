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


def _swiglu_store(rows: int, o_n: int):
    """The "swiglu" epilogue as a macro: rows [c0, c0 + rows) of the bf16 tile c_s to out rows [r0, r0 + rows),
    column block bx (o_n outputs wide)."""

    @T.macro
    def store(c_s, c0, out, r0, bx, aw, limit):
        for i, j in T.Parallel(rows, o_n):
            c = fp4_perm(j)  # the pair written at K position j of the down projection's input
            gate = T.cast(c_s[c0 + i, (c // HALF) * 2 * HALF + c % HALF], "float32")
            up = T.cast(c_s[c0 + i, (c // HALF) * 2 * HALF + HALF + c % HALF], "float32")
            gate = T.if_then_else(limit > 0, T.min(gate, limit), gate)
            up = T.if_then_else(limit > 0, T.max(T.min(up, limit), -limit), up)
            act = gate / (1.0 + T.exp(-gate)) * up
            out[r0 + i, bx * o_n + j] = T.cast(act * aw[r0 + i], "bfloat16")

    return store


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
    swiglu_store = _swiglu_store(block_m, o_n)
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
                swiglu_store(c_s, 0, out, by * block_m, bx, aw, limit)

    return fp4_expert_gemm


def build_fp4_expert_gemm_ws(n: int, k: int, epilogue: str, block_n: int = 256, block_k: int = 64,
                             regs: tuple = (192, 112)):
    """The candidate (moe_prefill.WARP_SPECIALISED): the same function over work items of one or two 64-row tiles
    of one expert, warp-specialised. prim_func(a [rows, k] bf16 (K permuted), item_tile [items] int32 (an item's
    first tile), item_n [items] int32 (its tiles, 1 or 2, the same expert), tile_expert [tiles] int32, w, s, aw, out,
    limit); grid (n / block_n, items).

    Why: the kernel above dequantises a weight tile with every thread, then multiplies it, then loads the next: the
    tensor cores wait during the dequantisation and the ALUs during the MMA (44-48% of the bf16 rate at full
    128-row tiles, ~40% at 64-row tiles in the prefill step). Here a producer warpgroup keeps the packed weight rows
    of two steps in flight in registers (alternate sets, so a step's HBM latency runs under the step before it) and
    dequantises each 64-K step into one half of a double weight buffer, while two math warpgroups multiply the other
    half, each its own 64-row tile (the second idle when an expert's last item has one tile), each loading its own
    activation rows one step ahead into the half its previous MMA has finished with: the dequantisation runs under
    the MMAs, and an expert's pair of tiles shares each dequantised weight. Each output element's K sum runs in the
    same k16 order as the kernel above. regs: registers a thread of a math warpgroup and of the producer."""
    assert epilogue in ("plain", "swiglu")
    BM, BN, BK = 64, block_n, block_k
    assert n % BN == 0 and k % BK == 0 and BK == 64 and BN == 256 and (k // BK) % 2 == 0
    n_out = n // 2 if epilogue == "swiglu" else n
    o_n = BN // 2 if epilogue == "swiglu" else BN
    swiglu_store = _swiglu_store(BM, o_n)
    NK = k // BK
    RPT = BN // 128                # weight rows a producer thread dequantises a step
    AV = BM * BK // 128            # activation values a math thread loads a step (half a row)
    REGM, REGP = regs
    assert 256 * REGM + 128 * REGP <= 65536
    launch_regs = 65536 // 384 // 8 * 8
    rows, items, tiles, experts = T.dynamic("rows"), T.dynamic("items"), T.dynamic("tiles"), T.dynamic("experts")

    @T.macro
    def load_w(kk, e, r0, pt, q_raw, s_raw, w, s):
        # step kk's packed rows (32 bytes a row) and their two scale bytes into one register set
        for i in T.unroll(RPT):
            for v in T.vectorized(BK // 2):
                q_raw[i * (BK // 2) + v] = w[e, r0 + pt * RPT + i, kk * (BK // 2) + v]
            for v in T.unroll(BK // 32):
                s_raw[i * (BK // 32) + v] = s[e, r0 + pt * RPT + i, kk * (BK // 32) + v]

    @T.macro
    def store_w(kk, pt, q_raw, s_raw, vals, w_s):
        # step kk dequantised into its half of the weight buffer
        for i in T.unroll(RPT):
            for g in T.unroll(BK // 8):
                T.call_extern("handle", "di_dq_e2m1x8", T.address_of(q_raw[i * (BK // 2) + g * 4]),
                              s_raw[i * (BK // 32) + g // 4], T.address_of(vals[0]))
                for v in T.vectorized(8):
                    w_s[(kk % 2) * BN + pt * RPT + i, g * 8 + v] = vals[v]
        T.fence_proxy_async()

    @T.macro
    def load_a(kk, r0, t, a_raw, a):
        # half a row of this tile's step-kk activations (thread t: row t // 2, columns (t % 2) * 32 ..)
        for v in T.vectorized(AV):
            a_raw[v] = a[r0 + t // 2, kk * BK + (t % 2) * AV + v]

    @T.macro
    def store_a(kk, mw, t, a_raw, a_s):
        for v in T.vectorized(AV):
            a_s[(kk % 2) * 2 * BM + mw * BM + t // 2, (t % 2) * AV + v] = a_raw[v]
        T.fence_proxy_async()  # generic stores -> the wgmma (async proxy) reads them

    @T.macro
    def math_wg(mw, t, t0, nt, bx, a_s, w_s, c_s, full, empty, a, aw, out, limit):
        # math warpgroup mw (a Python int): tile t0 + mw of the item, 64 rows x BN; waits and arrives every step
        # even without a tile (the barriers count both warpgroups)
        T.set_max_nreg(REGM, int(REGM > launch_regs))
        acc = T.alloc_fragment((BM, BN), "float32")
        a_raw = T.alloc_local((AV,), "bfloat16")
        r0 = (t0 + mw) * BM
        T.clear(acc)
        if mw < nt:
            load_a(0, r0, t, a_raw, a)
            store_a(0, mw, t, a_raw, a_s)
            T.sync_threads(1 + mw, 128)
        for kk in T.serial(NK):
            if mw < nt:
                if kk + 1 < NK:
                    load_a(kk + 1, r0, t, a_raw, a)  # in flight through the wait and the MMA below
                T.barrier_wait(full[kk % 2], (kk // 2) & 1)
                T.wgmma_gemm(a_s[(kk % 2) * 2 * BM + mw * BM:(kk % 2) * 2 * BM + (mw + 1) * BM, 0:BK],
                             w_s[(kk % 2) * BN:(kk % 2 + 1) * BN, 0:BK], acc, transpose_B=True)
                if kk + 1 < NK:  # the other half: its last reader, MMA kk - 1, is done
                    store_a(kk + 1, mw, t, a_raw, a_s)
                T.wait_wgmma(0)
                T.sync_threads(1 + mw, 128)  # every thread's step kk + 1 rows stored before any issues that MMA
            else:
                T.barrier_wait(full[kk % 2], (kk // 2) & 1)
            T.barrier_arrive(empty[kk % 2])
        if mw < nt:
            for i, j in T.Parallel(BM, BN):
                c_s[mw * BM + i, j] = T.cast(acc[i, j], "bfloat16")  # as the reference's GEMM output
            T.sync_threads(1 + mw, 128)
            if epilogue == "plain":
                for i, j in T.Parallel(BM, BN):
                    out[r0 + i, bx * BN + j] = c_s[mw * BM + i, j]
            else:
                swiglu_store(c_s, mw * BM, out, r0, bx, aw, limit)

    @T.prim_func
    def fp4_expert_gemm_ws(
        a: T.Tensor((rows, k), "bfloat16"),
        item_tile: T.Tensor((items,), "int32"),
        item_n: T.Tensor((items,), "int32"),
        tile_expert: T.Tensor((tiles,), "int32"),
        w: T.Tensor((experts, n, k // 2), "uint8"),
        s: T.Tensor((experts, n, k // 32), "uint8"),
        aw: T.Tensor((rows,), "float32"),
        out: T.Tensor((rows, n_out), "bfloat16"),
        limit: T.float32,
    ):
        with T.Kernel(n // BN, items, threads=384) as (bx, by):
            a_s = T.alloc_shared((4 * BM, BK), "bfloat16")  # step kk's two tiles at rows [(kk % 2) 128, + 128)
            w_s = T.alloc_shared((2 * BN, BK), "bfloat16")  # step kk's weights at rows [(kk % 2) BN, + BN)
            c_s = T.alloc_shared((2 * BM, BN), "bfloat16")  # the two tiles' outputs rounded to bf16
            full = T.alloc_barrier([128, 128])             # weight half i dequantised by the producer
            empty = T.alloc_barrier([256, 256])            # weight half i read by both math warpgroups
            tx = T.get_thread_binding()
            T.import_source(CUDA_SOURCE)
            t0 = item_tile[by]
            nt = item_n[by]
            e = tile_expert[t0]
            if tx < 128:
                math_wg(0, tx, t0, nt, bx, a_s, w_s, c_s, full, empty, a, aw, out, limit)
            elif tx < 256:
                math_wg(1, tx - 128, t0, nt, bx, a_s, w_s, c_s, full, empty, a, aw, out, limit)
            else:
                # ---- producer: two steps' packed rows in flight, in alternate register sets (A: even steps)
                T.set_max_nreg(REGP, int(REGP > launch_regs))
                pt = tx - 256
                qa = T.alloc_local((RPT * BK // 2,), "uint8")
                sa = T.alloc_local((RPT * BK // 32,), "uint8")
                qb = T.alloc_local((RPT * BK // 2,), "uint8")
                sb = T.alloc_local((RPT * BK // 32,), "uint8")
                vals = T.alloc_local((8,), "bfloat16")
                load_w(0, e, bx * BN, pt, qa, sa, w, s)
                load_w(1, e, bx * BN, pt, qb, sb, w, s)
                for it in T.serial(NK // 2):
                    T.barrier_wait(empty[0], (it & 1) ^ 1)
                    store_w(2 * it, pt, qa, sa, vals, w_s)
                    T.barrier_arrive(full[0])
                    if 2 * it + 2 < NK:
                        load_w(2 * it + 2, e, bx * BN, pt, qa, sa, w, s)
                    T.barrier_wait(empty[1], (it & 1) ^ 1)
                    store_w(2 * it + 1, pt, qb, sb, vals, w_s)
                    T.barrier_arrive(full[1])
                    if 2 * it + 3 < NK:
                        load_w(2 * it + 3, e, bx * BN, pt, qb, sb, w, s)

    return fp4_expert_gemm_ws
