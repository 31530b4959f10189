"""Decode attention over the caches as stored: shared-latent MQA (K = V, 64 heads x 512) with a per-head sink,
keys [0, W) from the sequence's FP8 window ring (e4m3 + ue8m0 per 32 channels), keys [W, W + topk) from the FP4
compressed-pool rows the indexer selected (e2m1 + e4m3 per 16 channels), split over keys; the partials go to
attention_combine_kernel. A window key is visible when q_pos - window < key_pos <= q_pos, a pool key when its
selected row is >= 0.

Warp-specialised and double-buffered (the earlier one-group kernel, load -> barrier -> QK -> softmax -> PV per
64-key block, left the tensor cores idle during loads and the softmax; 1.3-1.8x slower, git history and
benchmarks/results/attn_v2_gpu_h200.json). The structure follows FlashMLA's sparse-FP8 Hopper kernel: 384
threads, three warpgroups, one CTA per SM (211 KB shared: Q 64 KB, a double bf16 key buffer 2 x 64 KB, a double
P buffer 2 x 8 KB):

  WG0 (192 regs): S = Q K^T (4 x 8 wgmma m64n64k16, Q and K from shared), masked online softmax in the log2
                  domain, P -> shared, O[:, :256] += P V[:, :256] (4 x m64n256k16); QK of block n+1 is issued
                  right behind PV of block n, and key buffer n is released as soon as PV(n) is done.
  WG1 (160 regs): O[:, 256:] += P V[:, 256:] once WG0 has published P(n) and the rescale factor of block n.
  producer (152): builds the CTA's row table (window slot or pool row per key, -1 = invisible), then per
                  block: packed rows -> registers one block ahead (HBM latency under the MMAs), wait for a free
                  key buffer, dequantise into it (dequant.py), zeroing invisible rows (an empty ring slot may
                  hold bytes that dequantise to inf/NaN, and 0 * NaN in P V would poison the row).

Every role's block loop is one body, block n's buffers picked by n % 2 (rows [(n % 2) 64, (n % 2 + 1) 64) of the
key buffer, [(n % 2) 64, ...) of the P buffer), and a producer block takes the window's or the pool's path whole.
Loops unrolled two blocks an iteration, a copy a buffer and both paths in every row, made a ~79 KB producer loop
of sm_90a code that overflowed the SM's instruction caches beside the math warpgroups' loops: 1.6x slower at
B=256 (H100, docs/hopper-sessions.md; tools/kernel_code_size.py measures the loops).

Each half of O (64 x 256 fp32) lives in one math warpgroup's registers (128 per thread); K = V, so one key
buffer serves QK (K-major) and PV (MN-major). mbarriers: k_ready/k_free per key buffer half (producer <-> math),
p_ready/p_free per P buffer half (WG0 -> WG1 and back), bar_fin (WG0's final row scales). With one split each
math warpgroup writes its normalised half of the output into Q's shared memory (free once WG0's MMAs are done)
and stores it in 16-byte stores, a warp one head's 512 contiguous bytes. Several query tokens of a sequence are
separate CTAs: two tokens cannot share a CTA (two O accumulators = 256 KB of registers), and the window rows
they share are re-read from L2, not HBM.

The head dim is kept in dequant.py's twiddled order inside shared memory (Q is loaded permuted to match) and
un-twiddled when the output is stored (or by the combine kernel).
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE, fp4_perm

PROBES = ("", "no_load", "no_dequant", "no_producer", "no_softmax", "blocks1", "blocks2", "blocks1+no_q",
          "blocks1+no_out", "blocks1+no_q+no_out")
# cluster: a peer CTA's shared memory (mapa + ld.shared::cluster) and the cluster-wide barrier (release / acquire)
CLUSTER_SOURCE = r"""
__device__ __forceinline__ uint32_t di_peer(const void* p, uint32_t rank) {
  uint32_t a = (uint32_t)__cvta_generic_to_shared(p), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ float di_ld_peer_f32(const void* p, uint32_t rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(di_peer(p, rank)) : "memory");
  return v;
}
__device__ __forceinline__ void di_ld_peer_f32x8(void* dst, const void* base, int i, uint32_t rank) {
  uint32_t a = di_peer(reinterpret_cast<const float*>(base) + i, rank);
  float* d = reinterpret_cast<float*>(dst);
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]) : "r"(a) : "memory");
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]) : "r"(a + 16) : "memory");
}
// the key buffer's bytes as a plain [64, 512] fp32 array (TileLang's view of it would keep the buffer's swizzle)
__device__ __forceinline__ void di_st_f32(void* base, int i, float v) { reinterpret_cast<float*>(base)[i] = v; }
__device__ __forceinline__ void di_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" : : : "memory");
}
"""
# registers a thread of WG0, WG1 and the producer get after setmaxnreg, by wg1_rows (rows WG1 dequantises: registers
# move from the producer to WG1); each sums to at most the CTA's launch allocation (384 x 168, asserted below), in
# multiples of 8 (setmaxnreg's), without a spill (ptxas; 20 rows spill 8 bytes at 192 / 176 / 136). 24 and 32 rows
# (192 / 184 / 128, 192 / 192 / 120) lost to 16 in the thirty-ninth session and left the table
REGS = {0: (192, 160, 152), 12: (192, 168, 144), 16: (192, 176, 136), 20: (192, 184, 128)}
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
                                splits: int = 1, arch: str | None = None, regs: tuple | None = None,
                                ring: int | None = None, probe: str = "", cluster: bool = False, wg1_rows: int = 0):
    """prim_func(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, out, o_part,
    ml_part, scale). grid = (splits, n_q); splits > 1 writes partials for build_sink_combine(permuted=True). arch:
    None = the current target (wgmma on sm_90*, a synchronous gemm elsewhere, which only serves the lowering test).
    regs: registers per thread of WG0, WG1, producer (default REGS[wg1_rows]). ring: rows per sequence's ring
    (default `window`; wider when the caches keep rollback rows for speculative decoding). The window keys are read
    in position order, oldest first (slot j holds position p - window + 1 + j, ring row that position mod `ring`,
    kept when the ring row still holds it), whatever the ring's width: a query's sum runs over the same keys in the
    same order with and without rollback rows, so a verification row of speculative decoding is bitwise the plain
    decode row.
    probe: a timing probe that drops one part of the work (its output is wrong; benchmarks only,
    attention_decode_gpu.py --probes): "no_load" (the producer dequantises bytes it did not read), "no_dequant"
    (it reads the rows but writes no keys), "no_producer" (neither: the math warpgroups alone), "no_softmax" (WG0
    skips the mask, max, exp and rescale between QK and PV), "blocksN" (each split's first N key blocks only:
    T(default) - T(blocks1) over the blocks dropped is a block's cost, what is left of T(blocks1) the fixed part),
    and blocks1 without Q's loads ("+no_q"), without the output's global stores ("+no_out", its staging in shared
    memory kept) or without both. (A probe with no key block at all, "prologue" until the thirty-sixth session,
    lowered O without its MMA fragment layout: 64 threads of WG0 staged 256 values each into one bank, 32-way
    conflicted, so its time was not the kernel's fixed part.)
    cluster: with 2-16 splits, a query's splits run as one thread block cluster and merge their partials through
    distributed shared memory: each CTA leaves its un-normalised O (fp32, in the key buffer, free after the last
    block) and its m, l in its own shared memory, and after a cluster barrier each CTA combines a 1/splits share of
    the output's 16-byte pieces from every split's shared memory (build_sink_combine's arithmetic in its order, so
    the same bits) and stores it as bf16; no fp32 partials in HBM and no combine launch. Up to
    attention.CLUSTER_SPLITS splits (8) in the model.
    wg1_rows: rows of every key block that WG1 dequantises itself (a multiple of 4; 0 = the producer all 64), in the
    time it waits for WG0's P: the producer's share shrinks by as much (the same bits: a row's conversion is the
    same code in either role). WG1 converts blocks 0 and 1 up front, then block n + 2 into the half its PV(n) frees,
    its rows loaded one block ahead like the producer's; registers move from the producer to WG1 (regs)."""
    assert probe in PROBES, f"probe must be one of {PROBES}, got {probe!r}"
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
    assert wg1_rows % 4 == 0 and 0 <= wg1_rows < BK
    R1 = wg1_rows // 4             # rows per WG1 warp per block
    PR0 = BK - wg1_rows            # WG1's rows start here
    ROWS = PR0 // (n_prod // 32)   # rows per producer warp per block (lane l owns channels 16l..16l+15)
    hopper = _is_hopper(arch)
    # registers per thread after setmaxnreg: WG0 holds O/2 + S, WG1 O/2, the producer one block of packed rows
    REG0, REG1, REGP = regs or REGS[wg1_rows]
    QCH = 4 if hopper else 1       # QK commit groups (see qk)
    launch_regs = min(255, 65536 // threads) // 8 * 8  # what each thread gets before setmaxnreg
    # setmaxnreg moves registers between the warpgroups within what the CTA was launched with: a sum above it leaves
    # an increase waiting forever (a hang, not an error; the WG1-rows candidate's first GPU run)
    assert 128 * (REG0 + REG1) + n_prod * REGP <= threads * launch_regs, (regs, launch_regs)
    n_q, n_seq, n_pool = T.dynamic("n_q"), T.dynamic("n_seq"), T.dynamic("n_pool")
    single = splits == 1
    clustered = cluster and not single
    # more than 8 CTAs a cluster is a non-portable size (the launch allows it; an H100's GPCs hold 16-18 SMs)
    assert not clustered or (hopper and splits <= 16), "cluster: sm_90 and at most 16 splits"
    NG = H * D // 8                # the output's 16-byte pieces (8 channels of one head)
    PIECES = -(-NG // splits)      # cluster: pieces a CTA merges
    PS = 1 if clustered else splits  # partials' splits (clustered: unused, as with one split)
    parts = set(probe.split("+"))
    no_q, no_out = "no_q" in parts, "no_out" in parts
    # blocksN: each split's first N key blocks (a block keeps O's MMA fragment layout, which no block at all lost)
    few = next((int(x[6:]) for x in parts if x.startswith("blocks")), NB)
    assert 1 <= few <= NB
    no_load = probe in ("no_load", "no_producer")
    no_dequant = probe in ("no_dequant", "no_producer")

    def mma(a, b, c, transpose_B=False, clear_accum=False):
        # Hopper: asynchronous wgmma, completion waited explicitly; elsewhere (lowering only) a synchronous gemm
        if hopper:
            return T.wgmma_gemm(a, b, c, transpose_B=transpose_B, clear_accum=clear_accum)
        return T.gemm(a, b, c, transpose_B=transpose_B, clear_accum=clear_accum)

    @T.macro
    def qk(q_s, k_s, r0, s_acc):
        # S = Q K^T in QCH chunks of K (one commit group each, descriptor = base + c * 16 KB). As one gemm,
        # ptxas hoists all 32 k-step descriptors out of the block loop and spills them: WG0 has no registers
        # to spare next to O/2 and S (sm_90a, ptxas 13.0: 83 spill stores in WG0 -> 2)
        T.clear(s_acc)
        for c in T.serial(QCH):
            mma(q_s[:, c * (D // QCH):(c + 1) * (D // QCH)], k_s[r0:r0 + BK, c * (D // QCH):(c + 1) * (D // QCH)],
                s_acc, transpose_B=True)

    @T.macro
    def wait_mma(n):
        if hopper:
            T.wait_wgmma(n)

    @T.macro
    def wg0_block(n, nmine, k_s, p_s, q_s, s_acc, o_l, m_i, m_prev, l_i, rsum, alpha, idx_s, alpha_s, k_ready, k_free,
                  p_ready, p_free, scale2):
        # QK(n) was issued into s_acc (previous block or prologue); PV_L(n-1) has completed
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
        # P buffer half n % 2 was last read by WG1's wgmma for block n-2
        T.barrier_wait(p_free[n % 2], ((n // 2) & 1) ^ 1)
        T.copy(s_acc, p_s[(n % 2) * H:(n % 2 + 1) * H, 0:BK])
        for h in T.Parallel(H):
            alpha_s[n % 2, h] = alpha[h]
        T.fence_proxy_async()
        T.barrier_arrive(p_ready[n % 2])
        mma(p_s[(n % 2) * H:(n % 2 + 1) * H, 0:BK], k_s[(n % 2) * BK:(n % 2 + 1) * BK, 0:DH], o_l)
        if n + 1 < nmine:
            # QK(n+1) queues behind PV_L(n): the tensor cores stay busy while WG0 waits
            T.barrier_wait(k_ready[1 - n % 2], ((n + 1) // 2) & 1)
            qk(q_s, k_s, (1 - n % 2) * BK, s_acc)
            wait_mma(QCH)  # PV_L(n) is older than the QCH groups of QK(n+1)
        else:
            wait_mma(0)
        T.barrier_arrive(k_free[n % 2])  # PV_L(n) done: WG0 no longer reads key buffer half n % 2

    @T.macro
    def wg1_block(n, k_s, p_s, o_r, alpha_s, k_free, p_ready, p_free):
        T.barrier_wait(p_ready[n % 2], (n // 2) & 1)
        for h, d in T.Parallel(H, DH):
            o_r[h, d] *= alpha_s[n % 2, h]
        mma(p_s[(n % 2) * H:(n % 2 + 1) * H, 0:BK], k_s[(n % 2) * BK:(n % 2 + 1) * BK, DH:D], o_r)
        wait_mma(0)
        T.barrier_arrive(k_free[n % 2])
        T.barrier_arrive(p_free[n % 2])

    @T.macro
    def out_half(q_s, out, bq, t, c0):
        # one warpgroup's half of the output columns [c0, c0 + DH) from shared memory, a warp's 32 lanes storing one
        # head's 512 contiguous bytes (the fragments' own stores write 2 bytes a lane, 8 heads an instruction:
        # 1.36x slower at B=256 on an H100)
        for i in T.unroll(H * DH // 8 // 128):
            for v in T.vectorized(8):
                out[bq, (i * 128 + t) // (DH // 8), c0 + (i * 128 + t) % (DH // 8) * 8 + v] = \
                    q_s[(i * 128 + t) // (DH // 8), c0 + (i * 128 + t) % (DH // 8) * 8 + v]

    @T.macro
    def load_block(n, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, r0, nr):
        # block n's packed rows into registers (a window block's FP8 rows 16 bytes a row and lane, a pool block's FP4
        # rows 8), window or pool chosen once for the whole block; ok[i] holds row i's source row (-1: invisible)
        if no_load:  # bytes made from the row index: no HBM read
            for i in T.unroll(nr):
                row = idx_s[n * BK + r0 + warp * nr + i]
                ok[i] = row
                for v in T.vectorized(16):
                    raw[i * 16 + v] = T.cast((row + v) & 0x77, "uint8")
                sc[i] = T.cast(120, "uint8")
        elif kb0 + n < NWB:
            for i in T.unroll(nr):
                row = idx_s[n * BK + r0 + warp * nr + i]
                ok[i] = row
                for v in T.vectorized(16):
                    raw[i * 16 + v] = win_kv[b, T.max(row, 0), lane * 16 + v]
                sc[i] = win_scale[b, T.max(row, 0), lane // 2]
        else:
            for i in T.unroll(nr):
                row = idx_s[n * BK + r0 + warp * nr + i]
                ok[i] = row
                for v in T.vectorized(8):
                    raw[i * 16 + v] = cmp_kv[T.max(row, 0), lane * 8 + v]
                sc[i] = cmp_scale[T.max(row, 0), lane]

    @T.macro
    def store_row(n, k_s, warp, lane, i, visible, vals, r0, nr):
        # one dequantised row into block n's half of the key buffer, zeros where invisible
        for v in T.vectorized(16):
            k_s[(n % 2) * BK + r0 + warp * nr + i, lane * 16 + v] = T.if_then_else(visible, vals[v],
                                                                                   T.cast(0, "bfloat16"))

    @T.macro
    def keep_row(n, k_s, warp, lane, i, raw, sc, ok, r0, nr):
        # the no_dequant probes: no row is converted or written, but the loads stay (the compiler would drop them)
        if ok[i] == -7:  # never (rows are >= -1)
            for v in T.vectorized(16):
                k_s[(n % 2) * BK + r0 + warp * nr + i, lane * 16 + v] = T.cast(
                    T.cast(raw[i * 16 + v] + sc[i], "float32"), "bfloat16")

    @T.macro
    def dequant_block(n, kb0, k_s, lane, warp, raw, sc, ok, vals, r0, nr):
        # block n into rows [(n % 2) BK, (n % 2 + 1) BK) of the key buffer, window or pool chosen once
        if no_dequant:
            for i in T.unroll(nr):
                keep_row(n, k_s, warp, lane, i, raw, sc, ok, r0, nr)
        elif kb0 + n < NWB:
            for i in T.unroll(nr):
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16]), sc[i], T.address_of(vals[0]))
                T.call_extern("handle", "di_dq_e4m3x8", T.address_of(raw[i * 16 + 8]), sc[i], T.address_of(vals[8]))
                store_row(n, k_s, warp, lane, i, ok[i] >= 0, vals, r0, nr)
        else:
            for i in T.unroll(nr):
                # a pool row's 16 codes a lane in one call, the scale converted once and invisible rows zeroed through
                # it (dequant.py); two calls of 8 and a select after them, the same bits, ran 1% slower (B=256 and
                # 2048 at one split, H100, the thirty-seventh session)
                T.call_extern("handle", "di_dq_e2m1x16_e4m3", T.address_of(raw[i * 16]), sc[i], ok[i] >= 0,
                              T.address_of(vals[0]))
                for v in T.vectorized(16):
                    k_s[(n % 2) * BK + r0 + warp * nr + i, lane * 16 + v] = vals[v]
        T.fence_proxy_async()  # generic-proxy stores -> visible to the wgmma (async proxy) readers

    @T.macro
    def producer(nmine, kb0, b, lane, warp, idx_s, k_s, k_ready, k_free, win_kv, win_scale, cmp_kv, cmp_scale):
        # block n+1's rows are loaded right after block n is dequantised: their latency overlaps the wait for a
        # free key buffer half. Two blocks ahead in twice the registers gained nothing (H100, twenty-third session);
        # a half block ahead, loaded between the halves of this block's conversions in the same registers, lost
        # (B=2048, H100: 564 -> 581 us), though the producer stalls ~18% of its time on these loads (Nsight Compute)
        raw = T.alloc_local((ROWS * 16,), "uint8")
        sc = T.alloc_local((ROWS,), "uint8")
        ok = T.alloc_local((ROWS,), "int32")
        vals = T.alloc_local((16,), "bfloat16")
        if nmine > 0:
            load_block(0, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, 0, ROWS)
        for n in T.serial(nmine):
            T.barrier_wait(k_free[n % 2], ((n // 2) & 1) ^ 1)
            dequant_block(n, kb0, k_s, lane, warp, raw, sc, ok, vals, 0, ROWS)
            T.barrier_arrive(k_ready[n % 2])
            if n + 1 < nmine:
                load_block(n + 1, kb0, b, lane, warp, raw, sc, ok, idx_s, win_kv, win_scale, cmp_kv, cmp_scale, 0,
                           ROWS)

    @T.macro
    def merge(bs, bq, tx, k_s, ml_s, w_s, sink, out):
        # cluster: every split's partial is in its CTA's key buffer (a plain fp32 [H, D] array) after the barrier;
        # the weights per head as build_sink_combine computes them (max over the sink and the splits' m, in split
        # order), then this CTA's share of the 16-byte output pieces, each summed over the splits in index order
        T.call_extern("handle", "di_cluster_sync")
        if tx < H:
            m_all = T.alloc_var("float32", init=0.0)
            den = T.alloc_var("float32", init=0.0)
            m_sp = T.alloc_local((splits,), "float32")
            l_sp = T.alloc_local((splits,), "float32")
            for i in T.unroll(splits):  # every split's m and l, the loads issued together
                m_sp[i] = T.call_extern("float32", "di_ld_peer_f32", T.address_of(ml_s[0, tx]), i)
                l_sp[i] = T.call_extern("float32", "di_ld_peer_f32", T.address_of(ml_s[1, tx]), i)
            m_all = sink[tx]
            for i in T.unroll(splits):
                m_all = T.max(m_all, m_sp[i])
            den = T.exp(sink[tx] - m_all)
            for i in T.unroll(splits):
                den = den + l_sp[i] * T.exp(m_sp[i] - m_all)
            for i in T.unroll(splits):
                w_s[i, tx] = T.exp(m_sp[i] - m_all)
            w_s[splits, tx] = den
        T.sync_threads(9, threads)
        vals = T.alloc_local((8,), "float32")
        acc = T.alloc_local((8,), "float32")
        ov = T.alloc_local((8,), "bfloat16")
        for k in T.serial(T.ceildiv(PIECES, threads)):
            # this CTA's pieces are one contiguous range (whole 32-byte sectors of the output but at its ends);
            # piece c: head c // 64, twiddled channels (c % 64) * 8 .. + 8
            c = bs * PIECES + k * threads + tx
            if c < T.min((bs + 1) * PIECES, NG):
                for v in T.unroll(8):
                    acc[v] = 0.0
                for i in T.serial(splits):
                    T.call_extern("handle", "di_ld_peer_f32x8", T.address_of(vals[0]), T.address_of(k_s[0, 0]), c * 8,
                                  i)
                    for v in T.unroll(8):
                        acc[v] += vals[v] * w_s[i, c // (D // 8)]
                for v in T.unroll(8):  # un-twiddled: channel v of the piece is twiddled position fp4_perm^-1(v)
                    ov[v] = T.cast(acc[(v % 4) * 2 + v // 4] / w_s[splits, c // (D // 8)], "bfloat16")
                for v in T.vectorized(8):
                    out[bq, c // (D // 8), c % (D // 8) * 8 + v] = ov[v]
        T.call_extern("handle", "di_cluster_sync")  # no CTA leaves while a peer reads its shared memory

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
        o_part: T.Tensor((n_q, PS, H, D), "float32"),
        ml_part: T.Tensor((n_q, PS, 2, H), "float32"),
        scale: T.float32,
    ):
        with T.Kernel(splits, n_q, threads=threads, cluster_dims=(splits, 1, 1) if clustered else None) as (bs, bq):
            q_s = T.alloc_shared((H, D), "bfloat16")
            k_s = T.alloc_shared((2 * BK, D), "bfloat16")  # block n's keys at rows [(n % 2) BK, (n % 2 + 1) BK)
            ml_s = T.alloc_shared((2, H), "float32")       # cluster: this split's m (natural log) and l
            w_s = T.alloc_shared((splits + 1, H), "float32")  # cluster: each split's weight and the denominator
            p_s = T.alloc_shared((2 * H, BK), "bfloat16")  # block n's P at rows [(n % 2) H, (n % 2 + 1) H)
            alpha_s = T.alloc_shared((2, H), "float32")
            fin_s = T.alloc_shared((H,), "float32")
            idx_s = T.alloc_shared((PER * BK,), "int32")  # per key of this split: source row, -1 = invisible

            k_ready = T.alloc_barrier([n_prod + 128 * bool(R1)] * 2)  # key buffer half i dequantised (WG1's rows too)
            k_free = T.alloc_barrier([256, 256])           # key buffer half i no longer read by either math WG
            p_ready = T.alloc_barrier([128, 128])          # P / alpha half i written by WG0
            p_free = T.alloc_barrier([128, 128])           # P half i no longer read by WG1
            bar_fin = T.alloc_barrier(128)                 # WG0's final row scales in fin_s
            if R1:
                tab_ready = T.alloc_barrier(n_prod)        # the producer's row table is complete (WG1 reads it)

            tx = T.get_thread_binding()
            T.import_source(CUDA_SOURCE + (CLUSTER_SOURCE if clustered else ""))
            kb0 = bs * PER
            nmine = T.max(T.min(NB - kb0, min(PER, few)), 0)
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
                if not no_q:
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
                    qk(q_s, k_s, 0, s_acc)
                for n in T.serial(nmine):
                    wg0_block(n, nmine, k_s, p_s, q_s, s_acc, o_l, m_i, m_prev, l_i, rsum, alpha, idx_s, alpha_s,
                              k_ready, k_free, p_ready, p_free, scale2)
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
                    # through Q's shared memory (free: WG0's MMAs are done), then 16-byte stores
                    for h, d in T.Parallel(H, DH):
                        q_s[h, fp4_perm(d)] = T.cast(o_l[h, d] * rsum[h], "bfloat16")
                    T.sync_threads(6, 128)
                    if not no_out:
                        out_half(q_s, out, bq, tx, 0)
                elif clustered:
                    T.sync_threads(8, 256)  # WG1's last PV is done too: the key buffer is free for the partial
                    for h in T.Parallel(H):
                        ml_s[0, h] = m_i[h] * LN2
                        ml_s[1, h] = l_i[h]
                    for h, d in T.Parallel(H, DH):
                        T.call_extern("handle", "di_st_f32", T.address_of(k_s[0, 0]), h * D + d, o_l[h, d])
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
                if R1:
                    # its rows of blocks 0 and 1 (both halves start free), then of block n + 2 into the half PV(n)
                    # freed, loaded one block ahead
                    w_lane = (tx - 128) % 32
                    w_warp = (tx - 128) // 32
                    raw1 = T.alloc_local((R1 * 16,), "uint8")
                    sc1 = T.alloc_local((R1,), "uint8")
                    ok1 = T.alloc_local((R1,), "int32")
                    vals1 = T.alloc_local((16,), "bfloat16")
                    T.barrier_wait(tab_ready[0], 0)
                    for n in T.serial(T.min(nmine, 3)):
                        load_block(n, kb0, b, w_lane, w_warp, raw1, sc1, ok1, idx_s, win_kv, win_scale, cmp_kv,
                                   cmp_scale, PR0, R1)
                        if n < 2:
                            dequant_block(n, kb0, k_s, w_lane, w_warp, raw1, sc1, ok1, vals1, PR0, R1)
                            T.barrier_arrive(k_ready[n % 2])
                    for n in T.serial(nmine):
                        wg1_block(n, k_s, p_s, o_r, alpha_s, k_free, p_ready, p_free)
                        if n + 2 < nmine:
                            T.barrier_wait(k_free[n % 2], (n // 2) & 1)  # WG0's PV_L(n) is done with the half too
                            dequant_block(n + 2, kb0, k_s, w_lane, w_warp, raw1, sc1, ok1, vals1, PR0, R1)
                            T.barrier_arrive(k_ready[n % 2])
                            if n + 3 < nmine:
                                load_block(n + 3, kb0, b, w_lane, w_warp, raw1, sc1, ok1, idx_s, win_kv, win_scale,
                                           cmp_kv, cmp_scale, PR0, R1)
                else:
                    for n in T.serial(nmine):
                        wg1_block(n, k_s, p_s, o_r, alpha_s, k_free, p_ready, p_free)
                if single:
                    T.barrier_wait(bar_fin[0], 0)
                    # WG0 has passed its last MMA (bar_fin): Q's shared memory is free
                    for h, d in T.Parallel(H, DH):
                        q_s[h, fp4_perm(d) + DH] = T.cast(o_r[h, d] * fin_s[h], "bfloat16")
                    T.sync_threads(7, 128)
                    if not no_out:
                        out_half(q_s, out, bq, tx - 128, DH)
                elif clustered:
                    T.sync_threads(8, 256)
                    for h, d in T.Parallel(H, DH):
                        T.call_extern("handle", "di_st_f32", T.address_of(k_s[0, 0]), h * D + d + DH, o_r[h, d])
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
                if R1:
                    T.barrier_arrive(tab_ready[0])
                producer(nmine, kb0, b, lane, warp, idx_s, k_s, k_ready, k_free, win_kv, win_scale, cmp_kv, cmp_scale)

            if clustered:
                merge(bs, bq, tx, k_s, ml_s, w_s, sink, out)

    return sink_attention_decode
