"""mHC kernels: the per-site mixes (RMS statistic + projection by fn, then gates and Sinkhorn), the stream
collapse and the stream expand. Token counts are symbolic: one compiled kernel serves every batch size.

Mixes, kernel 1 (`mhc_premix`): per token the sum of squares over the flattened hc*D stream and the (2+hc)*hc dot
products with fn, on the tensor cores. fn is fp32 and the torch op's projection is fp32, so each fn tile is split in
shared memory into three bf16 terms (hi + mid + lo carry 24 mantissa bits) and the bf16 stream tile (exact) is
multiplied by all three: one wgmma of N = 3*24 (+8 zero rows, so it is one n=80 instruction, not nine n=8 ones).
Tensor cores round their fp32 accumulation toward zero, so each k-step's product is cleared and added into a
separate fp32 accumulator (round-to-nearest): the error stays at fp32 level over K = 20480 instead of growing
with the step count. At decode the K loop is split over `splits` blocks per 64-token tile so ~all SMs pull fn
(2 MB); each split writes [n_tok, 32] partials (24 dots, then the sum of squares).

Mixes, kernel 2 (`mhc_mix_finalize`): warps sum the split partials (lanes = columns), then one thread per token
applies the RMS scale, the sigmoid gates and the Sinkhorn projection on its 4x4 matrix in registers. Built with
`counters`, the premix does this itself: the last of a token tile's split blocks to finish (an arrival counter
per tile) sums the partials in split order and finalizes the tile, one launch instead of two (what that saves
at decode, where the finalize alone measured 5.4 us a call, is not measured yet).

Collapse / expand: pure bandwidth. Each block owns one token x `block_d` channels (16-byte vectors, 8 per thread),
so T = 1 still spreads over D / block_d blocks and T = 32768 is a long flat grid.
"""

import tilelang.language as T

from .counters import LD_CG_SOURCE, count_in

NOUT = 32  # partial row: dots [0, N), sum of squares at N; padded to 128 bytes

# The Sinkhorn rounds' reciprocal: the hardware's approximation plus one Newton step (within ~1 ulp of 1/x). IEEE
# `1.0f / x` (and __frcp_rn) carry a slow-path branch each, which keeps a normalisation's four reciprocals from
# overlapping: 20 rounds took 11.6 us a call at one token with them, 5.4 with this (H200, docs/hopper-sessions.md).
# x here is a sum of positive terms plus hc_eps, never denormal, so flushing denormals (ftz) changes nothing.
RCP_SOURCE = r"""
#ifndef DEEPINFER_MHC_RCP
#define DEEPINFER_MHC_RCP
__device__ __forceinline__ float di_rcp_nr(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return fmaf(r, fmaf(-x, r, 1.0f), r);
}
#endif
"""


def mix_width(hc: int) -> int:
    return (2 + hc) * hc


def build_mhc_premix(hc: int, dim: int, splits: int, block_t: int = 64, block_k: int = 64, stages: int = 3,
                     threads: int = 128, sinkhorn_iters: int = 0, counters: int = 0):
    """part[s, t, n] = sum over K-split s of x[t, k] * fn[n, k] (n < N); part[s, t, N] = sum of x[t, k]^2.

    counters = C > 0 (the fused mixes): the arguments are (x, fn, part, scale, base, pre, post, comb, counters [C]
    int32 all zero, hc_eps, norm_eps), and the last of a token tile's `splits` blocks to finish sums the tile's
    partials in split order and writes its tokens' pre / post / comb, as build_mhc_mix_finalize does in a second
    launch (the same sums in the same order: the same bits). Tile bx counts in counters[bx] (counters.count_in,
    the split GEMM's hand-over); the launcher keeps ceil(n_tok / block_t) <= C."""
    K, N = hc * dim, mix_width(hc)
    BT, BK, S = block_t, block_k, splits
    NP = -(-3 * N // 16) * 16  # three bf16 terms of fn, padded to a multiple of 16 rows
    assert N < NOUT and K % (BK * S) == 0 and BT == 64 and threads == 128
    steps = K // (BK * S)
    stages = max(1, min(stages, steps))
    fused = counters > 0
    assert not fused or sinkhorn_iters >= 1
    warps = threads // 32
    n_tok = T.dynamic("n_tok")

    @T.macro
    def premix(x, fn, part, out_s, bx, by):
        x_s = T.alloc_shared((BT, BK), "bfloat16")
        f_s = T.alloc_shared((N, BK), "float32")
        w_s = T.alloc_shared((NP, BK), "bfloat16")
        acc = T.alloc_fragment((BT, NP), "float32")
        tot = T.alloc_fragment((BT, NP), "float32")
        sq = T.alloc_fragment((BT, BK), "float32")
        ss = T.alloc_fragment((BT,), "float32")
        T.clear(tot)
        T.clear(sq)
        for i, j in T.Parallel(NP - 3 * N, BK):
            w_s[3 * N + i, j] = T.cast(0, "bfloat16")
        for k in T.Pipelined(steps, num_stages=stages):
            T.copy(x[bx * BT, (by * steps + k) * BK], x_s)
            T.copy(fn[0, (by * steps + k) * BK], f_s)
            for i, j in T.Parallel(N, BK):
                v = f_s[i, j]
                hi = T.cast(v, "bfloat16")
                r = v - T.cast(hi, "float32")  # exact
                mid = T.cast(r, "bfloat16")
                w_s[i, j] = hi
                w_s[N + i, j] = mid
                w_s[2 * N + i, j] = T.cast(r - T.cast(mid, "float32"), "bfloat16")
            for i, j in T.Parallel(BT, BK):
                xv = T.cast(x_s[i, j], "float32")
                sq[i, j] += xv * xv
            T.gemm(x_s, w_s, acc, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(BT, NP):
                tot[i, j] += acc[i, j]
        T.reduce_sum(sq, ss, dim=1)
        # the three terms of column n sit 24 columns apart: combine them through shared memory
        T.copy(tot, out_s[0:BT, 0:NP])
        for i in T.Parallel(BT):
            out_s[i, NP] = ss[i]
        for i, j in T.Parallel(BT, N + 1):
            if bx * BT + i < n_tok:
                jj = T.min(j, N - 1)
                part[by, bx * BT + i, j] = T.if_then_else(
                    j < N, out_s[i, jj] + (out_s[i, N + jj] + out_s[i, 2 * N + jj]), out_s[i, NP])

    if not fused:
        @T.prim_func
        def mhc_premix(
            x: T.Tensor((n_tok, K), "bfloat16"),
            fn: T.Tensor((N, K), "float32"),
            part: T.Tensor((S, n_tok, NOUT), "float32"),
        ):
            with T.Kernel(T.ceildiv(n_tok, BT), S, threads=threads) as (bx, by):
                out_s = T.alloc_shared((BT, NP + 1), "float32")
                premix(x, fn, part, out_s, bx, by)

        return mhc_premix

    finalize = last_block_finalize(hc, dim, sinkhorn_iters, S, BT, warps)

    @T.prim_func
    def mhc_mixes_fused(
        x: T.Tensor((n_tok, K), "bfloat16"),
        fn: T.Tensor((N, K), "float32"),
        part: T.Tensor((S, n_tok, NOUT), "float32"),
        scale: T.Tensor((3,), "float32"),
        base: T.Tensor((N,), "float32"),
        pre: T.Tensor((n_tok, hc), "float32"),
        post: T.Tensor((n_tok, hc), "float32"),
        comb: T.Tensor((n_tok, hc, hc), "float32"),
        cnt: T.Tensor((counters,), "int32"),
        hc_eps: T.float32,
        norm_eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(n_tok, BT), S, threads=threads) as (bx, by):
            T.import_source(RCP_SOURCE + LD_CG_SOURCE)
            out_s = T.alloc_shared((BT, NP + 1), "float32")  # the partial rows, then the summed ones (odd stride)
            arrived = T.alloc_shared((1,), "int32")
            total = T.alloc_local((1,), "float32")
            tx = T.get_thread_binding()
            premix(x, fn, part, out_s, bx, by)
            finalize(part, cnt, bx, bx * BT, n_tok, out_s, arrived, total, tx, scale, base, pre, post, comb, hc_eps,
                     norm_eps)

    return mhc_mixes_fused


def last_block_finalize(hc: int, dim: int, sinkhorn_iters: int, splits: int, rows: int, warps: int):
    """T.macro for a kernel whose `splits` blocks each wrote a tile's partials (part [splits, n_tok, NOUT]): the
    block counts in on counters[tile] (counters.count_in); the last of the tile's blocks sums the partials of its
    `rows` tokens from t0 in split order past L1 (build_mhc_mix_finalize's phase 1: warp w token i * warps + w, lane
    c column c), finalizes them (token_mixes, its phase 2) and zeroes the counter. out_s: shared [rows, >= 32]."""
    N, S = mix_width(hc), splits
    assert rows % warps == 0
    token_mixes = _token_mixes(hc, dim, sinkhorn_iters)

    @T.macro
    def finalize(part, cnt, tile, t0, n_tok, out_s, arrived, total, tx, scale, base, pre, post, comb, hc_eps,
                 norm_eps):
        lane = tx % 32
        count_in(cnt, tile, arrived, tx)
        if arrived[0] == S - 1:
            T.call_extern("handle", "__threadfence")
            for i in T.serial(rows // warps):
                total[0] = 0.0
                if t0 + i * warps + tx // 32 < n_tok and lane <= N:
                    for s in T.unroll(S):
                        total[0] += T.call_extern("float32", "di_ld_cg",
                                                  T.address_of(part[s, t0 + i * warps + tx // 32, lane]))
                out_s[i * warps + tx // 32, lane] = total[0]
            T.sync_threads()
            if tx < rows and t0 + tx < n_tok:
                token_mixes(out_s, tx, t0 + tx, scale, base, pre, post, comb, hc_eps, norm_eps)
            if tx == 0:
                cnt[tile] = 0

    return finalize


def _token_mixes(hc: int, dim: int, sinkhorn_iters: int):
    """T.macro: token t's pre / post / comb from its summed partial row red[row, :] (dots, then the sum of squares):
    the RMS scale, the gates and the Sinkhorn projection in one thread's registers (build_mhc_mix_finalize's
    phase 2, also the fused premix's last block)."""
    K, N, H = hc * dim, mix_width(hc), hc
    rounds = max(sinkhorn_iters - 1, 0)

    @T.macro
    def token_mixes(red, row, t, scale, base, pre, post, comb, hc_eps, norm_eps):
        m = T.alloc_local((N,), "float32")
        cm = T.alloc_local((H * H,), "float32")
        inv = T.alloc_local((H,), "float32")
        r = T.alloc_local((1,), "float32")
        r[0] = T.rsqrt(red[row, N] / K + norm_eps)
        for c in T.unroll(N):
            m[c] = red[row, c] * r[0]
        for c in T.unroll(H):
            pre[t, c] = T.sigmoid(m[c] * scale[0] + base[c]) + hc_eps
            post[t, c] = 2.0 * T.sigmoid(m[H + c] * scale[1] + base[H + c])
        for c in T.unroll(H * H):
            cm[c] = m[2 * H + c] * scale[2] + base[2 * H + c]
        # softmax over the last dim (k) of each row j, + eps
        for j in T.unroll(H):
            r[0] = cm[j * H]
            for k in T.unroll(H - 1):
                r[0] = T.max(r[0], cm[j * H + k + 1])
            for k in T.unroll(H):
                cm[j * H + k] = T.exp(cm[j * H + k] - r[0])
            r[0] = cm[j * H]
            for k in T.unroll(H - 1):
                r[0] = r[0] + cm[j * H + k + 1]
            for k in T.unroll(H):
                cm[j * H + k] = cm[j * H + k] / r[0] + hc_eps
        # one reciprocal per row / column (di_rcp_nr), then multiplies: within ~2 ulp of the divisions
        for rnd in T.serial(rounds + 1):
            if rnd > 0:
                for j in T.unroll(H):
                    r[0] = cm[j * H]
                    for k in T.unroll(H - 1):
                        r[0] = r[0] + cm[j * H + k + 1]
                    inv[j] = T.call_extern("float32", "di_rcp_nr", r[0] + hc_eps)
                for j in T.unroll(H):
                    for k in T.unroll(H):
                        cm[j * H + k] = cm[j * H + k] * inv[j]
            for k in T.unroll(H):
                r[0] = cm[k]
                for j in T.unroll(H - 1):
                    r[0] = r[0] + cm[(j + 1) * H + k]
                inv[k] = T.call_extern("float32", "di_rcp_nr", r[0] + hc_eps)
            for j in T.unroll(H):
                for k in T.unroll(H):
                    cm[j * H + k] = cm[j * H + k] * inv[k]
        for j in T.unroll(H):
            for k in T.unroll(H):
                comb[t, j, k] = cm[j * H + k]

    return token_mixes


def build_mhc_mix_finalize(hc: int, dim: int, splits: int, sinkhorn_iters: int, threads: int = 256):
    """pre [T, hc], post [T, hc], comb [T, hc, hc] (fp32) from the split partials; same math as the torch op:
    mixes = dots * rsqrt(sumsq / (hc*D) + norm_eps); pre = sigmoid(mixes*scale0 + base) + eps;
    post = 2 sigmoid(mixes*scale1 + base); comb = softmax_k(mixes*scale2 + base) + eps, column-normalised, then
    (iters - 1) rounds of row then column normalisation (rows = input stream j, dim -2 = column sums).

    Phase 1: warp w sums the partials of TW tokens, lane c owning column c; the split loop is unrolled so all its
    loads are in flight at once. Many splits (decode): one token per warp. Few splits (prefill): four, so that
    phase 2 (one thread per token, the 4x4 Sinkhorn in registers) runs a full warp. The fused premix
    (`build_mhc_premix(..., counters=C)`) does the same in its last block, in one launch; this kernel serves the
    token counts beyond its counters."""
    N, S, H = mix_width(hc), splits, hc
    warps = threads // 32
    TW = 1 if S > 4 else 4
    TPB = warps * TW
    assert TPB <= threads
    n_tok = T.dynamic("n_tok")
    token_mixes = _token_mixes(hc, dim, sinkhorn_iters)

    @T.prim_func
    def mhc_mix_finalize(
        part: T.Tensor((S, n_tok, NOUT), "float32"),
        scale: T.Tensor((3,), "float32"),
        base: T.Tensor((N,), "float32"),
        pre: T.Tensor((n_tok, H), "float32"),
        post: T.Tensor((n_tok, H), "float32"),
        comb: T.Tensor((n_tok, H, H), "float32"),
        hc_eps: T.float32,
        norm_eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(n_tok, TPB), threads=threads) as bx:
            T.import_source(RCP_SOURCE)
            tx = T.get_thread_binding()
            red = T.alloc_shared((TPB, NOUT + 1), "float32")  # +1: phase 2 reads a row per thread, no conflicts
            acc = T.alloc_local((1,), "float32")
            lane = tx % 32
            for i in T.serial(TW):
                tok = i * warps + tx // 32
                tw = bx * TPB + tok
                acc[0] = 0.0
                if tw < n_tok and lane <= N:
                    for s in T.unroll(S):
                        acc[0] += part[s, tw, lane]
                red[tok, lane] = acc[0]
            T.sync_threads()
            t = bx * TPB + tx
            if tx < TPB and t < n_tok:
                token_mixes(red, tx, t, scale, base, pre, post, comb, hc_eps, norm_eps)

    return mhc_mix_finalize


def build_mhc_collapse(hc: int, dim: int, block_d: int = 1024, threads: int = 128):
    """out[t, d] = sum_k pre[t, k] * x[t, k, d] in fp32, cast to bf16."""
    H, BD, V = hc, block_d, 8
    assert dim % BD == 0 and BD % (V * threads) == 0
    nd, per = dim // BD, BD // (V * threads)
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def mhc_collapse(
        x: T.Tensor((n_tok, H, dim), "bfloat16"),
        pre: T.Tensor((n_tok, H), "float32"),
        out: T.Tensor((n_tok, dim), "bfloat16"),
    ):
        with T.Kernel(n_tok * nd, threads=threads) as b:
            tx = T.get_thread_binding()
            t = b // nd
            p = T.alloc_local((H,), "float32")
            xr = T.alloc_local((H, V), "bfloat16")
            a = T.alloc_local((V,), "float32")
            o = T.alloc_local((V,), "bfloat16")
            for k in T.unroll(H):
                p[k] = pre[t, k]
            for it in T.unroll(per):
                d = (b % nd) * BD + (it * threads + tx) * V
                for k in T.unroll(H):  # all loads first: H 16-byte loads in flight per thread
                    for v in T.vectorized(V):
                        xr[k, v] = x[t, k, d + v]
                for v in T.unroll(V):
                    a[v] = p[0] * T.cast(xr[0, v], "float32")
                for k in T.unroll(H - 1):
                    for v in T.unroll(V):
                        a[v] += p[k + 1] * T.cast(xr[k + 1, v], "float32")
                for v in T.unroll(V):
                    o[v] = T.cast(a[v], "bfloat16")
                for v in T.vectorized(V):
                    out[t, d + v] = o[v]

    return mhc_collapse


def build_mhc_expand(hc: int, dim: int, block_d: int = 1024, threads: int = 128):
    """out[t, k, d] = post[t, k] * x[t, d] + sum_j comb[t, j, k] * res[t, j, d] in fp32, cast to bf16."""
    H, BD, V = hc, block_d, 8
    assert dim % BD == 0 and BD % (V * threads) == 0
    nd, per = dim // BD, BD // (V * threads)
    n_tok = T.dynamic("n_tok")

    @T.prim_func
    def mhc_expand(
        x: T.Tensor((n_tok, dim), "bfloat16"),
        res: T.Tensor((n_tok, H, dim), "bfloat16"),
        post: T.Tensor((n_tok, H), "float32"),
        comb: T.Tensor((n_tok, H, H), "float32"),
        out: T.Tensor((n_tok, H, dim), "bfloat16"),
    ):
        with T.Kernel(n_tok * nd, threads=threads) as b:
            tx = T.get_thread_binding()
            t = b // nd
            p = T.alloc_local((H,), "float32")
            c = T.alloc_local((H * H,), "float32")
            xr = T.alloc_local((V,), "bfloat16")
            rr = T.alloc_local((H, V), "bfloat16")
            a = T.alloc_local((V,), "float32")
            o = T.alloc_local((V,), "bfloat16")
            for k in T.unroll(H):
                p[k] = post[t, k]
            for i in T.unroll(H * H):
                c[i] = comb[t, i // H, i % H]
            for it in T.unroll(per):
                d = (b % nd) * BD + (it * threads + tx) * V
                for v in T.vectorized(V):
                    xr[v] = x[t, d + v]
                for j in T.unroll(H):
                    for v in T.vectorized(V):
                        rr[j, v] = res[t, j, d + v]
                for k in T.unroll(H):
                    for v in T.unroll(V):
                        a[v] = p[k] * T.cast(xr[v], "float32")
                    for j in T.unroll(H):
                        for v in T.unroll(V):
                            a[v] += c[j * H + k] * T.cast(rr[j, v], "float32")
                    for v in T.unroll(V):
                        o[v] = T.cast(a[v], "bfloat16")
                    for v in T.vectorized(V):
                        out[t, k, d + v] = o[v]

    return mhc_expand
