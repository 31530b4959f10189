"""Decode attention over the caches as stored: shared-latent MQA (K = V, 64 heads x 512) with a per-head sink,
keys [0, W) from the sequence's FP8 window ring (e4m3 + ue8m0 per 32 channels), keys [W, W + topk) from the FP4
compressed-pool rows the indexer selected (e2m1 + e4m3 per 16 channels), split over keys; the partials go to
attention_combine_kernel. A window key is visible when q_pos - window < key_pos <= q_pos, a pool key when its
selected row is >= 0.

Warp-specialised and double-buffered (the earlier one-group kernel, load -> barrier -> QK -> softmax -> PV per
64-key block, left the tensor cores idle during loads and the softmax; 1.3-1.8x slower, git history and
benchmarks/results/attn_v2_gpu_h200.json). The structure follows FlashMLA's sparse-FP8 Hopper kernel: 384
threads, three warpgroups, one CTA per SM (211 KB shared: Q 64 KB, two bf16 key buffers 2 x 64 KB, two P buffers 2 x 8 KB):

  WG0 (192 regs): S = Q K^T (4 x 8 wgmma m64n64k16, Q and K from shared), masked online softmax in the log2
                  domain, P -> shared, O[:, :256] += P V[:, :256] (4 x m64n256k16); QK of block n+1 is issued
                  right behind PV of block n, and key buffer n is released as soon as PV(n) is done.
  WG1 (160 regs): O[:, 256:] += P V[:, 256:] once WG0 has published P(n) and the rescale factor of block n.
  producer (152): builds the CTA's row table (window slot or pool row per key, -1 = invisible), then per
                  block: packed rows -> registers one block ahead (HBM latency under the MMAs), wait for a free
                  key buffer, dequantise into it (dequant.py), zeroing invisible rows (an empty ring slot may
                  hold bytes that dequantise to inf/NaN, and 0 * NaN in P V would poison the row).

Each half of O (64 x 256 fp32) lives in one math warpgroup's registers (128 per thread); K = V, so one key
buffer serves QK (K-major) and PV (MN-major). mbarriers: k_ready/k_free per key buffer (producer <-> math),
p_ready/p_free per P buffer (WG0 -> WG1 and back), bar_fin (WG0's final row scales). Several query tokens of a
sequence are separate CTAs: two tokens cannot share a CTA (two O accumulators = 256 KB of registers), and the
window rows they share are re-read from L2, not HBM.

The head dim is kept in dequant.py's twiddled order inside shared memory (Q is loaded permuted to match) and
un-twiddled when the output is stored (or by the combine kernel).
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE, fp4_perm

PROBES = ("", "no_load", "no_dequant", "no_producer", "no_softmax", "prologue")
LD8_SOURCE = r"""
__device__ __forceinline__ void di_ld8(void* dst, const void* src) {
  *reinterpret_cast<uint2*>(dst) = __ldg(reinterpret_cast<const uint2*>(src));
}
"""
NEG_BIG = -1.0e30  # running-max start: finite, so exp2(m_prev - m_new) never sees inf - inf
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _is_hopper(arch):
    if arch is None:
        from tvm.target import Target

        tgt = Target.current(allow_none=True)
        arch = str(tgt.attrs.get("arch", "sm_90a")) if tgt is not None else "sm_90a"
    return arch.startswith("sm_90")


def build_sink_attention_decode(heads: int = 64, dim: int = 512, window: int = 128, topk: int = 512,
                                splits: int = 1, arch: str | None = None, regs: tuple = (192, 160, 152),
                                ring: int | None = None, probe: str = "", prefetch: int = 1, compact: int = 0,
                                stage_out: bool = False):
    """prim_func(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, out, o_part,
    ml_part, scale). grid = (splits, n_q); splits > 1 writes partials for build_sink_combine(permuted=True). arch: None = the current target (wgmma on sm_90*, a synchronous gemm
    elsewhere, which only serves the lowering test). regs: registers per thread of WG0, WG1, producer. ring: rows
    per sequence's ring (default `window`; wider when the caches keep rollback rows for speculative decoding).
    The window keys are read in position order, oldest first (slot j holds position p - window + 1 + j, ring row
    that position mod `ring`, kept when the ring row still holds it), whatever the ring's width: a query's sum runs
    over the same keys in the same order with and without rollback rows, so a verification row of speculative
    decoding is bitwise the plain decode row.
    probe: a timing probe that drops one part of the work (its output is wrong; benchmarks only,
    attention_decode_gpu.py --probes): "no_load" (the producer dequantises bytes it did not read), "no_dequant"
    (it reads the rows but writes no keys), "no_producer" (neither: the math warpgroups alone), "no_softmax" (WG0
    skips the mask, max, exp and rescale between QK and PV), "prologue" (no key block at all: the launch, Q into
    shared memory and the output's stores).
    prefetch: how far ahead the producer loads a pool block's rows (1: the next block, right after the current
    one is dequantised, as the H200 has run it; 2: two ahead, in alternate halves of its row registers, so a
    block's HBM latency overlaps the dequantisation of the one before; window blocks stay one ahead); A/B:
    attention.PREFETCH.
    compact: loops as one body instead of unrolled two blocks an iteration (a copy a key / P buffer). 0: as the
    H200 has run it; the producer's copies each carry the window's and the pool's path in every row, a ~79 KB loop
    of sm_90a code, where an SM's instruction caches also hold the math warpgroups' loops (~23 and ~5 KB). 1: the
    producer as one body over one shared buffer of both key buffers (2 x 64 rows, a block's half by its index),
    window or pool chosen once a block (~42 KB, a block runs one contiguous ~20 KB path). 2: the math warpgroups
    too, over one double P buffer (~12.5 and ~3 KB; P is stored without stmatrix, whose addresses TileLang does
    not offset at run time); ptxas spills nothing at any split count. With prefetch 2 the producer has one body
    for the window blocks and one for the pool blocks, each pool block dequantised from the row registers' first
    half, the next block's rows then moved up from the second half and the block two ahead loaded into it.
    tools/kernel_code_size.py measures the loops. A/B: attention.COMPACT.
    stage_out: with one split, the bf16 output goes through Q's shared memory (free once WG0's MMAs are done) and out
    in 16-byte stores, a warp one head's 512 contiguous bytes; False: each thread stores its fragment's 2-byte
    values straight to global memory (256 stores a thread, 8 heads' 8-byte pieces an instruction), as the H200
    has run it. A/B: attention.STAGE_OUT."""
    assert probe in PROBES, f"probe must be one of {PROBES}, got {probe!r}"
    assert prefetch in (1, 2) and not (prefetch == 2 and probe), "prefetch is 1 or 2 (2: not with a probe)"
    assert compact in (0, 1, 2) and not (compact and probe), "compact is 0, 1 or 2 (not with a probe)"
    H, D, BK = heads, dim, 64
    W = ring or window             # ring rows per sequence
    assert H == 64 and D == 512 and W % BK == 0 and topk % BK == 0 and W >= window and window % BK == 0
    NWB = window // BK             # window key blocks per query
    NB = NWB + topk // BK          # key blocks per query
    PER = -(-NB // splits)         # blocks per split (the last may have fewer)
    # every split starts inside the keys (attention.used_splits): nmine's clamp at 0 below is folded away by
    # TileLang, so a split past the end would read beyond its query's selection
    assert (splits - 1) * PER < NB, f"{splits} splits of {NB} blocks leave a split past the end: use used_splits"
    DH = D // 2
    n_prod = 128  # one producer warpgroup (two: ptxas cannot fit WG0's wgmma in 128 launch registers)
    threads = 256 + n_prod
    ROWS = BK // (n_prod // 32)    # rows per producer warp per block (lane l owns channels 16l..16l+15)
    hopper = _is_hopper(arch)
    # registers per thread after setmaxnreg: WG0 holds O/2 + S, WG1 O/2, the producer one block of packed rows
    REG0, REG1, REGP = regs
    QCH = 4 if hopper else 1       # QK commit groups (see qk)
    launch_regs = min(255, 65536 // threads) // 8 * 8  # what each thread gets before setmaxnreg
    assert 128 * (REG0 + REG1) + n_prod * REGP <= 65536
    n_q, n_seq, n_pool = T.dynamic("n_q"), T.dynamic("n_seq"), T.dynamic("n_pool")
    KROWS, R1 = (2 * BK, BK) if compact else (BK, 0)  # rows of k0, and key buffer 1's first row in its buffer
    PROWS, P1 = (2 * H, H) if compact >= 2 else (H, 0)  # the same for the P buffers
    single = splits == 1

    def mma(a, b, c, transpose_B=False, clear_accum=False):
        # Hopper: asynchronous wgmma, completion waited explicitly; elsewhere (lowering only) a synchronous gemm
        if hopper:
            return T.wgmma_gemm(a, b, c, transpose_B=transpose_B, clear_accum=clear_accum)
        return T.gemm(a, b, c, transpose_B=transpose_B, clear_accum=clear_accum)

    @T.macro
    def qk(q_s, kbuf, r0, s_acc):
        # S = Q K^T in QCH chunks of K (one commit group each, descriptor = base + c * 16 KB). As one gemm,
        # ptxas hoists all 32 k-step descriptors out of the block loop and spills them: WG0 has no registers
        # to spare next to O/2 and S (sm_90a, ptxas 13.0: 83 spill stores in WG0 -> 2)
        T.clear(s_acc)
        for c in T.serial(QCH):
            mma(q_s[:, c * (D // QCH):(c + 1) * (D // QCH)], kbuf[r0:r0 + BK, c * (D // QCH):(c + 1) * (D // QCH)],
                s_acc, transpose_B=True)

    @T.macro
    def wait_mma(n):
        if hopper:
            T.wait_wgmma(n)

    @T.macro
    def wg0_block(n, nmine, kcur, rcur, knext, rnext, pbuf, prow, sb, q_s, s_acc, o_l, m_i, m_prev, l_i, rsum, alpha,
                  idx_s, alpha_s, k_ready, k_free, p_ready, p_free, scale2):
        # QK(n) was issued into s_acc (previous block or prologue); PV_L(n-1) has completed. Block n's key rows
        # start at row rcur of kcur (block n+1's at rnext of knext), its P at row prow of pbuf; sb = n % 2
        wait_mma(0)
        if probe == "no_softmax":
            for h in T.Parallel(H):
                alpha[h] = 1.0
        else:
            for h, j in T.Parallel(H, BK):
                s_acc[h, j] = T.if_then_else(idx_s[n * BK + j] >= 0, s_acc[h, j] * scale2, -T.infinity("float32"))
            T.copy(m_i, m_prev)
            T.reduce_max(s_acc, m_i, dim=1, clear=False)
            for h in T.Parallel(H):
                alpha[h] = T.exp2(m_prev[h] - m_i[h])
            for h, j in T.Parallel(H, BK):
                s_acc[h, j] = T.exp2(s_acc[h, j] - m_i[h])
            T.reduce_sum(s_acc, rsum, dim=1)
            for h in T.Parallel(H):
                l_i[h] = l_i[h] * alpha[h] + rsum[h]
            for h, d in T.Parallel(H, DH):
                o_l[h, d] *= alpha[h]
        # P buffer sb was last read by WG1's wgmma for block n-2
        T.barrier_wait(p_free[sb], ((n // 2) & 1) ^ 1)
        T.copy(s_acc, pbuf[prow:prow + H, 0:BK])
        for h in T.Parallel(H):
            alpha_s[sb, h] = alpha[h]
        T.fence_proxy_async()
        T.barrier_arrive(p_ready[sb])
        mma(pbuf[prow:prow + H, 0:BK], kcur[rcur:rcur + BK, 0:DH], o_l)
        if n + 1 < nmine:
            # QK(n+1) queues behind PV_L(n): the tensor cores stay busy while WG0 waits
            T.barrier_wait(k_ready[1 - sb], ((n + 1) // 2) & 1)
            qk(q_s, knext, rnext, s_acc)
            wait_mma(QCH)  # PV_L(n) is older than the QCH groups of QK(n+1)
        else:
            wait_mma(0)
        T.barrier_arrive(k_free[sb])  # PV_L(n) done: WG0 no longer reads key buffer sb

    @T.macro
    def wg1_block(n, kcur, rcur, pbuf, prow, sb, o_r, alpha_s, k_free, p_ready, p_free):
        T.barrier_wait(p_ready[sb], (n // 2) & 1)
        for h, d in T.Parallel(H, DH):
            o_r[h, d] *= alpha_s[sb, h]
        mma(pbuf[prow:prow + H, 0:BK], kcur[rcur:rcur + BK, DH:D], o_r)
        wait_mma(0)
        T.barrier_arrive(k_free[sb])
        T.barrier_arrive(p_free[sb])

    @T.macro
    def out_half(q_s, out, bq, t, c0):
        # stage_out: one warpgroup's half of the output columns [c0, c0 + DH) from shared memory, a warp's 32 lanes
        # storing one head's 512 contiguous bytes (the direct stores write 2 bytes a lane, 8 heads an instruction)
        for i in T.unroll(H * DH // 8 // 128):
            for v in T.vectorized(8):
                out[bq, (i * 128 + t) // (DH // 8), c0 + (i * 128 + t) % (DH // 8) * 8 + v] = \
                    q_s[(i * 128 + t) // (DH // 8), c0 + (i * 128 + t) % (DH // 8) * 8 + v]

    @T.macro
    def load_raw(n, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, slot=0):
        # one block's packed rows into registers, issued ahead so HBM latency overlaps the MMAs. prefetch 2: a pool
        # block's 8 bytes a row go to half `slot` of each row's 16 (a window block fills both halves), and ok[slot]
        # holds the rows' visibility as bits (ok[i] holds row i's source row otherwise)
        for i in T.unroll(ROWS):
            row = idx_s[n * BK + warp * ROWS + i]
            if prefetch == 2:
                ok[slot] = T.if_then_else(i == 0, 0, ok[slot]) | T.if_then_else(row >= 0, 1 << i, 0)
            else:
                ok[i] = row
            if probe in ("no_load", "no_producer"):
                for v in T.vectorized(16):
                    raw[i * 16 + v] = T.cast((row + v) & 0x77, "uint8")
                sc[i] = T.cast(120, "uint8")
            elif kb0 + n < NWB:
                for v in T.vectorized(16):
                    raw[i * 16 + v] = win_kv[b, T.max(row, 0), lane * 16 + v]
                sc[slot * ROWS + i] = win_scale[b, T.max(row, 0), lane // 2]
            else:
                if prefetch == 2:  # one 8-byte load (TileLang leaves some of these copies as 8 byte loads)
                    T.call_extern("handle", "di_ld8", T.address_of(raw[i * 16 + slot * 8]),
                                  T.address_of(cmp_kv[T.max(row, 0), lane * 8]))
                else:
                    for v in T.vectorized(8):
                        raw[i * 16 + slot * 8 + v] = cmp_kv[T.max(row, 0), lane * 8 + v]
                sc[slot * ROWS + i] = cmp_scale[T.max(row, 0), lane]

    @T.macro
    def dequant(n, kb0, kbuf, lane, warp, raw, sc, ok, vals, slot=0):
        for i in T.unroll(ROWS):
            if probe in ("no_dequant", "no_producer"):
                if ok[i] == -7:  # never (rows are >= -1), but keeps the loads the compiler would drop
                    for v in T.vectorized(16):
                        kbuf[warp * ROWS + i, lane * 16 + v] = T.cast(T.cast(raw[i * 16 + v] + sc[i], "float32"),
                                                                      "bfloat16")
            elif kb0 + n < NWB:
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16]), sc[slot * ROWS + i],
                              T.address_of(vals[0]))
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16 + 8]), sc[slot * ROWS + i],
                              T.address_of(vals[8]))
            else:
                T.call_extern("handle", "di_dq_e2m1x8_e4m3", T.address_of(raw[i * 16 + slot * 8]),
                              sc[slot * ROWS + i], T.address_of(vals[0]))
                T.call_extern("handle", "di_dq_e2m1x8_e4m3", T.address_of(raw[i * 16 + slot * 8 + 4]),
                              sc[slot * ROWS + i], T.address_of(vals[8]))
            if probe not in ("no_dequant", "no_producer"):
                for v in T.vectorized(16):
                    kbuf[warp * ROWS + i, lane * 16 + v] = T.if_then_else(
                        (((ok[slot] >> i) & 1) > 0) if prefetch == 2 else (ok[i] >= 0), vals[v],
                        T.cast(0, "bfloat16"))
        T.fence_proxy_async()  # generic-proxy stores -> visible to the wgmma (async proxy) readers

    @T.macro
    def producer_one_ahead(nmine, kb0, b, lane, warp, idx_s, k0, k1, k_ready, k_free, win_kv, win_scale, cmp_kv,
                           cmp_scale):
        # block n+1's rows are loaded right after block n is dequantised: their latency overlaps the wait for a
        # free key buffer only
        raw = T.alloc_local((ROWS * 16,), "uint8")
        sc = T.alloc_local((ROWS,), "uint8")
        ok = T.alloc_local((ROWS,), "int32")
        vals = T.alloc_local((16,), "bfloat16")
        if nmine > 0:
            load_raw(0, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale)
        for it in T.serial((nmine + 1) // 2):
            T.barrier_wait(k_free[0], (it & 1) ^ 1)
            dequant(it * 2, kb0, k0, lane, warp, raw, sc, ok, vals)
            T.barrier_arrive(k_ready[0])
            if it * 2 + 1 < nmine:
                load_raw(it * 2 + 1, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv,
                         cmp_scale)
                T.barrier_wait(k_free[1], (it & 1) ^ 1)
                dequant(it * 2 + 1, kb0, k1, lane, warp, raw, sc, ok, vals)
                T.barrier_arrive(k_ready[1])
                if it * 2 + 2 < nmine:
                    load_raw(it * 2 + 2, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv,
                             cmp_scale)

    @T.macro
    def load_after(n, par, nmine, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale):
        # after block n (local parity par, a Python int) is dequantised: a window block next is loaded alone
        # (its FP8 rows fill both halves of the registers); after the last window block the next two pool
        # blocks; after a pool block the pool block two ahead, into the half block n has just freed
        if kb0 + n + 1 < NWB:
            if n + 1 < nmine:
                load_raw(n + 1, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale,
                         1 - par)
        elif kb0 + n < NWB:
            if n + 1 < nmine:
                load_raw(n + 1, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale,
                         1 - par)
            if n + 2 < nmine:
                load_raw(n + 2, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, par)
        else:
            if n + 2 < nmine:
                load_raw(n + 2, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, par)

    @T.macro
    def producer_two_ahead(nmine, kb0, b, lane, warp, idx_s, k0, k1, k_ready, k_free, win_kv, win_scale, cmp_kv,
                           cmp_scale):
        # pool blocks (FP4: 8 bytes a row and lane) two ahead, in alternate halves of the row registers: a block's
        # loads are in flight while the one before it is dequantised, not only during the wait for its buffer
        raw = T.alloc_local((ROWS * 16,), "uint8")
        sc = T.alloc_local((2 * ROWS,), "uint8")
        ok = T.alloc_local((2,), "int32")  # each half's rows visible, as bits
        vals = T.alloc_local((16,), "bfloat16")
        ok[0] = 0
        ok[1] = 0
        if nmine > 0:
            load_raw(0, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, 0)
            if kb0 >= NWB and nmine > 1:
                load_raw(1, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, 1)
        for it in T.serial((nmine + 1) // 2):
            T.barrier_wait(k_free[0], (it & 1) ^ 1)
            dequant(it * 2, kb0, k0, lane, warp, raw, sc, ok, vals, 0)
            T.barrier_arrive(k_ready[0])
            load_after(it * 2, 0, nmine, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv,
                       cmp_scale)
            if it * 2 + 1 < nmine:
                T.barrier_wait(k_free[1], (it & 1) ^ 1)
                dequant(it * 2 + 1, kb0, k1, lane, warp, raw, sc, ok, vals, 1)
                T.barrier_arrive(k_ready[1])
                load_after(it * 2 + 1, 1, nmine, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv,
                           cmp_scale)

    @T.macro
    def load_window(n, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, bits):
        # compact: window block n's FP8 rows into the row registers (16 bytes a row and lane); visibility as each
        # row's source row in ok[i], or (bits) as bit i of ok[0]
        for i in T.unroll(ROWS):
            row = idx_s[n * BK + warp * ROWS + i]
            if bits:
                ok[0] = T.if_then_else(i == 0, 0, ok[0]) | T.if_then_else(row >= 0, 1 << i, 0)
            else:
                ok[i] = row
            for v in T.vectorized(16):
                raw[i * 16 + v] = win_kv[b, T.max(row, 0), lane * 16 + v]
            sc[i] = win_scale[b, T.max(row, 0), lane // 2]

    @T.macro
    def store_row(n, kk, warp, lane, i, visible, vals):
        # compact: one dequantised row into block n's half of the double key buffer, zeros where invisible
        for v in T.vectorized(16):
            kk[(n % 2) * BK + warp * ROWS + i, lane * 16 + v] = T.if_then_else(visible, vals[v], T.cast(0, "bfloat16"))

    @T.macro
    def load_block(n, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale):
        # compact: one block's packed rows into registers, window or pool chosen once for the whole block
        if kb0 + n < NWB:
            load_window(n, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, False)
        else:
            for i in T.unroll(ROWS):
                row = idx_s[n * BK + warp * ROWS + i]
                ok[i] = row
                for v in T.vectorized(8):
                    raw[i * 16 + v] = cmp_kv[T.max(row, 0), lane * 8 + v]
                sc[i] = cmp_scale[T.max(row, 0), lane]

    @T.macro
    def dequant_block(n, kb0, kk, lane, warp, raw, sc, ok, vals):
        # compact: block n into rows [(n % 2) BK, (n % 2 + 1) BK) of the one key buffer, window or pool chosen once
        if kb0 + n < NWB:
            for i in T.unroll(ROWS):
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16]), sc[i], T.address_of(vals[0]))
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16 + 8]), sc[i], T.address_of(vals[8]))
                store_row(n, kk, warp, lane, i, ok[i] >= 0, vals)
        else:
            for i in T.unroll(ROWS):
                T.call_extern("handle", "di_dq_e2m1x8_e4m3", T.address_of(raw[i * 16]), sc[i], T.address_of(vals[0]))
                T.call_extern("handle", "di_dq_e2m1x8_e4m3", T.address_of(raw[i * 16 + 4]), sc[i],
                              T.address_of(vals[8]))
                store_row(n, kk, warp, lane, i, ok[i] >= 0, vals)
        T.fence_proxy_async()

    @T.macro
    def producer_compact(nmine, kb0, b, lane, warp, idx_s, kk, k_ready, k_free, win_kv, win_scale, cmp_kv,
                         cmp_scale):
        # one loop body for every block (the unrolled producers above keep a copy a key buffer, each with both the
        # window and the pool path in every row: a ~79 KB loop on sm_90a, where this one is ~42 KB and a block runs
        # one contiguous ~20 KB path of it: tools/kernel_code_size.py); the schedule is producer_one_ahead's
        raw = T.alloc_local((ROWS * 16,), "uint8")
        sc = T.alloc_local((ROWS,), "uint8")
        ok = T.alloc_local((ROWS,), "int32")
        vals = T.alloc_local((16,), "bfloat16")
        if nmine > 0:
            load_block(0, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale)
        for n in T.serial(nmine):
            T.barrier_wait(k_free[n % 2], ((n // 2) & 1) ^ 1)
            dequant_block(n, kb0, kk, lane, warp, raw, sc, ok, vals)
            T.barrier_arrive(k_ready[n % 2])
            if n + 1 < nmine:
                load_block(n + 1, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale)

    @T.macro
    def load_pool_half(n, half, lane, warp, raw, sc, ok, idx_s, cmp_kv, cmp_scale):
        # compact, two ahead: pool block n's 8 bytes a row into half `half` of the row registers, its visibility as
        # bits in ok[half]
        for i in T.unroll(ROWS):
            row = idx_s[n * BK + warp * ROWS + i]
            ok[half] = T.if_then_else(i == 0, 0, ok[half]) | T.if_then_else(row >= 0, 1 << i, 0)
            T.call_extern("handle", "di_ld8", T.address_of(raw[i * 16 + half * 8]),
                          T.address_of(cmp_kv[T.max(row, 0), lane * 8]))
            sc[half * ROWS + i] = cmp_scale[T.max(row, 0), lane]

    @T.macro
    def producer_compact_two_ahead(nmine, kb0, b, lane, warp, idx_s, kk, k_ready, k_free, win_kv, win_scale, cmp_kv,
                                   cmp_scale):
        # one loop body for the window blocks (one ahead: their FP8 rows fill the registers) and one for the pool
        # blocks, which keep two blocks in flight: a block is dequantised from the registers' first half, the next
        # block's rows (loaded a block earlier) move from the second half to the first, and the block two ahead
        # goes into the second. The move waits for rows that have had a whole block's time to land, where the
        # one-ahead producer waits on rows issued just before its wait for a free key buffer
        raw = T.alloc_local((ROWS * 16,), "uint8")
        sc = T.alloc_local((2 * ROWS,), "uint8")
        ok = T.alloc_local((2,), "int32")  # each half's rows visible, as bits
        vals = T.alloc_local((16,), "bfloat16")
        nwin = T.min(T.max(NWB - kb0, 0), nmine)  # this split's window blocks: its first ones
        ok[0] = 0
        ok[1] = 0
        if nwin > 0:
            load_window(0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, True)
        else:
            if nmine > 0:
                load_pool_half(0, 0, lane, warp, raw, sc, ok, idx_s, cmp_kv, cmp_scale)
            if nmine > 1:
                load_pool_half(1, 1, lane, warp, raw, sc, ok, idx_s, cmp_kv, cmp_scale)
        for n in T.serial(nwin):
            T.barrier_wait(k_free[n % 2], ((n // 2) & 1) ^ 1)
            for i in T.unroll(ROWS):
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16]), sc[i], T.address_of(vals[0]))
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16 + 8]), sc[i], T.address_of(vals[8]))
                store_row(n, kk, warp, lane, i, ((ok[0] >> i) & 1) > 0, vals)
            T.fence_proxy_async()
            T.barrier_arrive(k_ready[n % 2])
            if n + 1 < nwin:
                load_window(n + 1, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, True)
            else:  # the first two pool blocks
                if n + 1 < nmine:
                    load_pool_half(n + 1, 0, lane, warp, raw, sc, ok, idx_s, cmp_kv, cmp_scale)
                if n + 2 < nmine:
                    load_pool_half(n + 2, 1, lane, warp, raw, sc, ok, idx_s, cmp_kv, cmp_scale)
        for j in T.serial(nmine - nwin):
            n = nwin + j
            T.barrier_wait(k_free[n % 2], ((n // 2) & 1) ^ 1)
            for i in T.unroll(ROWS):
                T.call_extern("handle", "di_dq_e2m1x8_e4m3", T.address_of(raw[i * 16]), sc[i], T.address_of(vals[0]))
                T.call_extern("handle", "di_dq_e2m1x8_e4m3", T.address_of(raw[i * 16 + 4]), sc[i],
                              T.address_of(vals[8]))
                store_row(n, kk, warp, lane, i, ((ok[0] >> i) & 1) > 0, vals)
            T.fence_proxy_async()
            T.barrier_arrive(k_ready[n % 2])
            if n + 1 < nmine:
                for i in T.unroll(ROWS):
                    for v in T.vectorized(8):
                        raw[i * 16 + v] = raw[i * 16 + 8 + v]
                    sc[i] = sc[ROWS + i]
                ok[0] = ok[1]
            if n + 2 < nmine:
                load_pool_half(n + 2, 1, lane, warp, raw, sc, ok, idx_s, cmp_kv, cmp_scale)

    @T.prim_func
    def sink_attention_decode(
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
        o_part: T.Tensor((n_q, splits, H, D), "float32"),
        ml_part: T.Tensor((n_q, splits, 2, H), "float32"),
        scale: T.float32,
    ):
        with T.Kernel(splits, n_q, threads=threads) as (bs, bq):
            q_s = T.alloc_shared((H, D), "bfloat16")
            # the two key buffers; compact: one buffer of both, block n's at rows [(n % 2) BK, (n % 2 + 1) BK)
            k0 = T.alloc_shared((KROWS, D), "bfloat16")
            k1 = k0 if compact else T.alloc_shared((BK, D), "bfloat16")
            p0 = T.alloc_shared((PROWS, BK), "bfloat16")
            p1 = p0 if compact >= 2 else T.alloc_shared((H, BK), "bfloat16")
            alpha_s = T.alloc_shared((2, H), "float32")
            fin_s = T.alloc_shared((H,), "float32")
            idx_s = T.alloc_shared((PER * BK,), "int32")  # per key of this split: source row, -1 = invisible

            k_ready = T.alloc_barrier([n_prod, n_prod])    # key buffer i dequantised
            k_free = T.alloc_barrier([256, 256])           # key buffer i no longer read by either math WG
            p_ready = T.alloc_barrier([128, 128])          # P / alpha buffer i written by WG0
            p_free = T.alloc_barrier([128, 128])           # P buffer i no longer read by WG1
            bar_fin = T.alloc_barrier(128)                 # WG0's final row scales in fin_s

            tx = T.get_thread_binding()
            T.import_source(CUDA_SOURCE + (LD8_SOURCE if prefetch == 2 else ""))
            kb0 = bs * PER
            nmine = T.max(T.min((0 if probe == "prologue" else NB) - kb0, PER), 0)
            b = q_seq[bq]
            p = q_pos[bq]

            if tx < 128:
                # ---- WG0: QK^T, online softmax, O[:, :256]
                T.set_max_nreg(REG0, int(REG0 > launch_regs))
                s_acc = T.alloc_fragment((H, BK), "float32")
                o_l = T.alloc_fragment((H, DH), "float32")
                m_i = T.alloc_fragment((H,), "float32")
                m_prev = T.alloc_fragment((H,), "float32")
                l_i = T.alloc_fragment((H,), "float32")
                rsum = T.alloc_fragment((H,), "float32")
                alpha = T.alloc_fragment((H,), "float32")
                scale2 = scale * LOG2E
                # Q -> shared in the twiddled head-dim order (16-byte loads, permuted in registers); WG0 alone
                # reads Q, so the other roles start without waiting for it. The source interleaves each load with
                # its store; ptxas issues all 32 loads first (sm_90a SASS, tools/kernel_code_size.py's cubin)
                qv = T.alloc_local((8,), "bfloat16")
                qt = T.alloc_local((8,), "bfloat16")
                for i0 in T.unroll(32):
                    for v in T.vectorized(8):
                        qv[v] = q[bq, (i0 * 128 + tx) // 64, (i0 * 128 + tx) % 64 * 8 + v]
                    for v in T.unroll(8):
                        qt[v] = qv[(v % 2) * 4 + v // 2]
                    for v in T.vectorized(8):
                        q_s[(i0 * 128 + tx) // 64, (i0 * 128 + tx) % 64 * 8 + v] = qt[v]
                T.fence_proxy_async()
                T.fill(m_i, NEG_BIG)
                T.fill(l_i, 0.0)
                T.fill(o_l, 0.0)
                if nmine > 0:
                    T.barrier_wait(k_ready[0], 0)
                    qk(q_s, k0, 0, s_acc)
                for n in T.serial(nmine if compact >= 2 else 0):  # one body, buffers by the block's index
                    wg0_block(n, nmine, k0, (n % 2) * BK, k0, (1 - n % 2) * BK, p0, (n % 2) * H, n % 2, q_s, s_acc,
                              o_l, m_i, m_prev, l_i, rsum, alpha, idx_s, alpha_s, k_ready, k_free, p_ready, p_free,
                              scale2)
                for it in T.serial(0 if compact >= 2 else (nmine + 1) // 2):
                    wg0_block(it * 2, nmine, k0, 0, k1, R1, p0, 0, 0, q_s, s_acc, o_l, m_i, m_prev, l_i, rsum, alpha,
                              idx_s, alpha_s, k_ready, k_free, p_ready, p_free, scale2)
                    if it * 2 + 1 < nmine:
                        wg0_block(it * 2 + 1, nmine, k1, R1, k0, 0, p1, P1, 1, q_s, s_acc, o_l, m_i, m_prev, l_i, rsum,
                                  alpha, idx_s, alpha_s, k_ready, k_free, p_ready, p_free, scale2)
                wait_mma(0)
                if single:
                    for h in T.Parallel(H):
                        # the sink joins the denominator only: out = O e^-M / (l e^-M + e^(sink - M))
                        alpha[h] = T.max(m_i[h], sink[h] * LOG2E)
                        rsum[h] = T.exp2(m_i[h] - alpha[h]) / (l_i[h] * T.exp2(m_i[h] - alpha[h])
                                                               + T.exp2(sink[h] * LOG2E - alpha[h]))
                    for h in T.Parallel(H):
                        fin_s[h] = rsum[h]
                    T.barrier_arrive(bar_fin[0])
                    if stage_out:  # through Q's shared memory (free: WG0's MMAs are done), then 16-byte stores
                        for h, d in T.Parallel(H, DH):
                            q_s[h, fp4_perm(d)] = T.cast(o_l[h, d] * rsum[h], "bfloat16")
                        T.sync_threads(6, 128)
                        out_half(q_s, out, bq, tx, 0)
                    else:
                        for h, d in T.Parallel(H, DH):
                            out[bq, h, fp4_perm(d)] = T.cast(o_l[h, d] * rsum[h], "bfloat16")
                else:
                    for h in T.Parallel(H):
                        ml_part[bq, bs, 0, h] = m_i[h] * LN2  # natural-log max, as the combine expects
                        ml_part[bq, bs, 1, h] = l_i[h]
                    for h, d in T.Parallel(H, DH):
                        o_part[bq, bs, h, d] = o_l[h, d]

            elif tx < 256:
                # ---- WG1: O[:, 256:]
                T.set_max_nreg(REG1, int(REG1 > launch_regs))
                o_r = T.alloc_fragment((H, DH), "float32")
                T.fill(o_r, 0.0)
                for n in T.serial(nmine if compact >= 2 else 0):
                    wg1_block(n, k0, (n % 2) * BK, p0, (n % 2) * H, n % 2, o_r, alpha_s, k_free, p_ready, p_free)
                for it in T.serial(0 if compact >= 2 else (nmine + 1) // 2):
                    wg1_block(it * 2, k0, 0, p0, 0, 0, o_r, alpha_s, k_free, p_ready, p_free)
                    if it * 2 + 1 < nmine:
                        wg1_block(it * 2 + 1, k1, R1, p1, P1, 1, o_r, alpha_s, k_free, p_ready, p_free)
                if single:
                    T.barrier_wait(bar_fin[0], 0)
                    if stage_out:  # WG0 has passed its last MMA (bar_fin): Q's shared memory is free
                        for h, d in T.Parallel(H, DH):
                            q_s[h, fp4_perm(d) + DH] = T.cast(o_r[h, d] * fin_s[h], "bfloat16")
                        T.sync_threads(7, 128)
                        out_half(q_s, out, bq, tx - 128, DH)
                    else:
                        for h, d in T.Parallel(H, DH):
                            out[bq, h, fp4_perm(d) + DH] = T.cast(o_r[h, d] * fin_s[h], "bfloat16")
                else:
                    for h, d in T.Parallel(H, DH):
                        o_part[bq, bs, h, d + DH] = o_r[h, d]

            else:
                # ---- producer warpgroup: row table, then each block's rows loaded one block ahead and dequantised
                T.set_max_nreg(REGP, int(REGP > launch_regs))
                pt = tx - 256
                lane = pt % 32
                warp = pt // 32
                for i in T.serial(T.ceildiv(PER * BK, n_prod)):  # ptxas unrolls it, its loads issued together
                    if i * n_prod + pt < nmine * BK:
                        kb = kb0 + (i * n_prod + pt) // BK
                        r = (i * n_prod + pt) % BK
                        if kb < NWB:
                            pp = p - window + 1 + kb * BK + r  # the slot's position; its ring row is pp mod W
                            row = T.max(pp, 0) % W
                            idx_s[i * n_prod + pt] = T.if_then_else((pp >= 0) and (win_pos[b, row] == pp), row, -1)
                        else:
                            idx_s[i * n_prod + pt] = sel[bq, (kb - NWB) * BK + r]
                T.sync_threads(5, n_prod)  # producers only: the row table is complete

                if compact and prefetch == 2:
                    producer_compact_two_ahead(nmine, kb0, b, lane, warp, idx_s, k0, k_ready, k_free, win_kv,
                                               win_scale, cmp_kv, cmp_scale)
                elif compact:
                    producer_compact(nmine, kb0, b, lane, warp, idx_s, k0, k_ready, k_free, win_kv, win_scale, cmp_kv,
                                     cmp_scale)
                elif prefetch == 2:
                    producer_two_ahead(nmine, kb0, b, lane, warp, idx_s, k0, k1, k_ready, k_free, win_kv,
                                       win_scale, cmp_kv, cmp_scale)
                else:
                    producer_one_ahead(nmine, kb0, b, lane, warp, idx_s, k0, k1, k_ready, k_free, win_kv,
                                       win_scale, cmp_kv, cmp_scale)

    return sink_attention_decode
