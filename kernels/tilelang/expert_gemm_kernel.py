"""Grouped GEMM over FP4 experts for prefill-sized token counts, "swap AB" with the weights dequantised into wgmma
A registers: each block computes C^T[128 weight rows, block_t tokens] = W_e[rows, K] . A[tile, K]^T for one tile of
block_t rows of `a` from tile_row[tile] (all of one expert, e = tile_expert[tile]; moe_prefill launches it once
per tile height: an expert's 128-row tiles, then its odd 64-row one).

Why: the previous generation (in git history) dequantised each FP4 weight tile into shared memory as bf16 for wgmma
to read back: per 64-K step of a 64 x 256 tile, 32 KB written + 32 KB read + the activations, more shared-memory
traffic than the MMAs at full rate (43-49% of the bf16 rate with full 128-row tiles, H100 and H200). Here each
thread dequantises its own A fragment (moe_kernel.py's di3_e2m1x8 bit placement, two rows x 16 codes per 64-K
step) and the tokens ride on the wgmma N side (block_t = 64 or 128), so shared memory carries the packed weights
(4 KB a step), the activation tile (read by wgmma) and nothing else; one weight fragment feeds block_t tokens.
Measured on an H100 (benchmarks/results/prefill_kernels_*_s27_h100.json), both kernels in one run, 128-row tiles:
59.6% / 61.8% of the bf16 rate (gate/up, down) against 43.9% / 49.2%; the MoE at 8,192 tokens 12.19 ms against
15.28 ms. That run's build still serialised its MMAs (below); the current source has not yet run on a device.

No branch between the MMAs: the next stage's copies are predicated (a step past the end copies nothing) rather
than skipped by an `if`. With a conditional block between one step's wgmma and the next, ptxas could not prove
the in-flight MMAs' A registers safe, serialised every wgmma (a wait after each, one register set for all: its
warning C7513) and the measured kernel ran so; tests/test_tilelang_lowering_expert_gemm.py holds the build to no
such warning.

K order: the A fragments hold codes in moe_kernel.k_index's order, so `a` holds its K columns in that order too
(`mma_order`; the caller permutes the activations once, and the SwiGLU epilogue writes its output in that order,
ready to be the down projection's `a`). The dot products are unchanged.

Layout per stage (S stages from a 1024-byte boundary, one 64-K step each): packed weights [128][32 bytes], then the
activation tile in the wgmma K-major 128-byte-swizzled layout (token n's 128 bytes in row n, its 16-byte chunk c at
(c ^ (n & 7)) * 16; SBO 1024), loaded straight by cp.async (no permute: `a` is already in MMA order). The scale
bytes of the block's 128 rows over all of K sit after the stages (loaded once, with the first stage).

Pipeline per step k (one barrier a step): wait for step k's stage and fence it to the async proxy (each thread its
own cp.async writes, which wgmma reads); wgmma wait_group 1 (this warpgroup's MMAs of step k-2 done); barrier
(everyone's step k-2 MMAs done, so its slot is free); issue step k+S-2 into that slot; dequantise step k into A
buffer k&1 (step k-1's MMAs may still read the other) and issue its 4 MMAs.

Epilogue: the accumulators, rounded to bf16 (the reference's GEMM output), go through shared memory (over the stage
slots) as [tokens][rows]; "plain" writes out[row, n] = bf16(acc); "swiglu" pairs each gate row with its up row (the
[32 gate | 32 up] interleave of PackedExperts) and writes bf16(silu(min(g, L)) * clamp(u, +-L) * aw[row]) at the
down projection's K position (mma_order). The padding rows of a tile compute garbage that is never read past the
epilogue of their own rows (zero rows give zeros).

On other targets than sm_90a the same fragments feed mma.sync m16n8k16 (identical A/C register layouts).
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE as DEQUANT_SOURCE
from .moe_kernel import _HEAD, _wgmma_fn, k_index

ROWS = 128          # weight rows per block: two warpgroups of 64 (the wgmma M)
THREADS = 256
W_BYTES = ROWS * 32  # packed FP4 weights of one 64-K step
CS_PAD = 8          # bf16 epilogue tile [BT][128 + 8]
STAGES = 4          # cp.async stages: two steps in flight ahead of the one multiplied
HALF = 32           # gate (or up) rows per 64-row group of the packed w13


def mma_order(k: int) -> list[int]:
    """Source column of each MMA K position: position j of `a` holds natural column mma_order(k)[j]."""
    return [k_index(j) for j in range(k)]


_MAIN = r"""
#ifndef DEEPINFER_XRS_H
#define DEEPINFER_XRS_H
// K step kk (64 K) into stage st: weights (128 rows x 32 bytes), then the activation tile (BT tokens x 128 bytes);
// nothing copied when !pred (kk is then any step inside K: the addresses stay valid). Predicated, never skipped by a
// branch: a conditional block between two steps' MMAs makes ptxas serialise every wgmma (module docstring).
template <int BT>
__device__ __forceinline__ void xrs_issue(uint8_t* st, const uint8_t* a, int a_ld, const uint8_t* w, int w_ld,
                                          int kk, int tid, int pred) {
  di3_cp16(st + (tid >> 1) * 32 + (tid & 1) * 16, w + (size_t)(tid >> 1) * w_ld + kk * 32 + (tid & 1) * 16, pred);
  // token n's 64 K (128 bytes) in row n of a 128-byte-swizzled K-major tile: chunk c at (c ^ (n & 7)) * 16; a warp
  // covers 4 whole rows (coalesced reads, conflict-free writes)
  uint8_t* xs = st + XRS_W_BYTES;
#pragma unroll
  for (int it = 0; it < BT / 32; ++it) {
    const int n = (tid >> 3) + 32 * it, c = tid & 7;
    di3_cp16(xs + n * 128 + ((c ^ (n & 7)) << 4), a + (size_t)n * a_ld + kk * 128 + c * 16, pred);
  }
}

// the step k in stage st (BUF = k & 1, the A buffer, a compile-time index so both buffers stay in registers):
// dequantise into the A fragments and issue its 4 MMAs
template <int BT, int BUF>
__device__ __forceinline__ void xrs_group(const uint8_t* st, const uint8_t* s_all, int s_ld, int k,
                                          uint32_t* a_all, float* acc) {
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid >> 2) & 7, q = tid & 3;
  const int r0 = 64 * (warp >> 2) + 16 * (warp & 3) + g, r1 = r0 + 8;
  const uint2 p0 = *reinterpret_cast<const uint2*>(st + r0 * 32 + 8 * q);
  const uint2 p1 = *reinterpret_cast<const uint2*>(st + r1 * 32 + 8 * q);
  const uint32_t s0 = di3_scale_e2m1(s_all[r0 * s_ld + 2 * k + (q >> 1)]);
  const uint32_t s1 = di3_scale_e2m1(s_all[r1 * s_ld + 2 * k + (q >> 1)]);
  uint32_t d0[8], d1[8];
  di3_e2m1x8(p0.x, s0, d0);
  di3_e2m1x8(p0.y, s0, d0 + 4);
  di3_e2m1x8(p1.x, s1, d1);
  di3_e2m1x8(p1.y, s1, d1 + 4);
  uint32_t* af = a_all + 16 * BUF;  // its last reader, step k-2's MMAs, was retired by xrs_step's wait
  di3_place_a(af, d0, d1);
  const uint8_t* xs = st + XRS_W_BYTES;
#if DI3_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  // K-major, 128-byte swizzle (layout type 1 at bits 62-63): SBO 1024 bytes (the next 8 tokens), LBO unused (1);
  // k16 block t starts 32 bytes further along the row (the swizzle is applied by the hardware to the address)
  const uint64_t desc0 = (1ull << 62) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 16) |
                         (uint64_t)((di3_smem(xs) >> 4) & 0x3FFF);
#pragma unroll
  for (int t = 0; t < 4; ++t) XRS_WGMMA_N(af + 4 * t, desc0 + (uint64_t)(2 * t), acc);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
#pragma unroll
  for (int t = 0; t < 4; ++t) {
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
      const uint8_t* row = xs + (8 * j + g) * 128;  // token 8j + g; its K pairs 16t + 2q (+8) in chunks 2t (+1)
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(row + (((2 * t) ^ g) << 4) + 4 * q);
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(row + (((2 * t + 1) ^ g) << 4) + 4 * q);
      float* c4 = acc + 4 * j;
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};\n"
                   : "+f"(c4[0]), "+f"(c4[1]), "+f"(c4[2]), "+f"(c4[3])
                   : "r"(af[4 * t]), "r"(af[4 * t + 1]), "r"(af[4 * t + 2]), "r"(af[4 * t + 3]), "r"(b0), "r"(b1));
    }
  }
#endif
}

// step k of the K loop: its stage landed and fenced, one barrier, the stage S-2 ahead issued, its MMAs
template <int BT, int S, int BUF>
__device__ __forceinline__ void xrs_step(uint8_t* smem, const uint8_t* s_all, const uint8_t* a, int a_ld,
                                         const uint8_t* w, int w_ld, int s_ld, int nk, int k, uint32_t* a_all,
                                         float* acc) {
  constexpr int STAGE = XRS_W_BYTES + BT * 128;
  di3_cp_wait<S - 3>();
  di3_fence_async();  // this thread's cp.async writes of step k (generic proxy) -> the wgmma reads (async proxy)
  di3_wgmma_wait<1>();  // this warpgroup's step k-2 MMAs (the last readers of its slot and of A buffer BUF) done
  __syncthreads();
  const int ahead = k + S - 2;
  xrs_issue<BT>(smem + (ahead % S) * STAGE, a, a_ld, w, w_ld, min(ahead, nk - 1), threadIdx.x, ahead < nk);
  di3_cp_commit();
  xrs_group<BT, BUF>(smem + (k % S) * STAGE, s_all, s_ld, k, a_all, acc);
}

// the K loop of one block: acc[BT/2] (wgmma D layout) = W[128 rows, K] . A[BT tokens, K]^T over nk (even) steps of
// 64 K
template <int BT, int S>
__device__ __forceinline__ void xrs_mainloop(void* smem_, const void* a_, long long a_off, int a_ld, const void* w_,
                                             int w_ld, const void* s_, int s_ld, int nk, float* acc) {
  // the stages from a 1024-byte boundary: the 128-byte swizzle's pattern repeats every 1024 bytes of address
  uint8_t* smem = static_cast<uint8_t*>(smem_) + ((1024u - (di3_smem(smem_) & 1023u)) & 1023u);
  // the tile's byte offset is passed apart: TileLang 0.1.15 fails to lower &a[by * BT, 0] at some widths (2304)
  const uint8_t* a = static_cast<const uint8_t*>(a_) + a_off;
  const uint8_t* w = static_cast<const uint8_t*>(w_);
  const uint8_t* s = static_cast<const uint8_t*>(s_);
  constexpr int STAGE = XRS_W_BYTES + BT * 128;
  uint8_t* s_all = smem + S * STAGE;
  const int tid = threadIdx.x;
  uint32_t a_all[32];
  for (int i = tid; i < XRS_ROWS * (s_ld / 8); i += blockDim.x) {
    const int r = i / (s_ld / 8), c = i % (s_ld / 8);
    di3_cp_small<8>(s_all + r * s_ld + c * 8, s + (size_t)r * s_ld + c * 8, 1);
  }
#pragma unroll
  for (int p = 0; p < S - 2; ++p) {
    xrs_issue<BT>(smem + p * STAGE, a, a_ld, w, w_ld, min(p, nk - 1), tid, p < nk);
    di3_cp_commit();
  }
  // the A buffers alternate between steps (nk is even: no branch between two steps' MMAs)
  for (int k = 0; k < nk; k += 2) {
    xrs_step<BT, S, 0>(smem, s_all, a, a_ld, w, w_ld, s_ld, nk, k, a_all, acc);
    xrs_step<BT, S, 1>(smem, s_all, a, a_ld, w, w_ld, s_ld, nk, k + 1, a_all, acc);
  }
  di3_wgmma_wait<0>();
  di3_fence_regs(acc, BT / 2);
  __syncthreads();  // every warp is past its last reads of the stages: the epilogue tile may overwrite them
}

// acc (wgmma D layout: acc[i] = row 16*(warp&3) + g + 8*((i>>1)&1) of the warpgroup, token 8*(i>>2) + 2q + (i&1))
// rounded to bf16 into cs[token][row] (row pitch XRS_ROWS + XRS_CS_PAD)
template <int BT>
__device__ __forceinline__ void xrs_store_acc(const float* acc, void* cs_) {
  __nv_bfloat16* cs = reinterpret_cast<__nv_bfloat16*>(cs_);
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid >> 2) & 7, q = tid & 3;
  const int r = 64 * (warp >> 2) + 16 * (warp & 3) + g;
#pragma unroll
  for (int i = 0; i < BT / 2; ++i)
    cs[(8 * (i >> 2) + 2 * q + (i & 1)) * (XRS_ROWS + XRS_CS_PAD) + r + 8 * ((i >> 1) & 1)] =
        __float2bfloat16_rn(acc[i]);
  __syncthreads();
}

// moe_kernel.k_index inside one 64-K group: the natural column of MMA K position j
__device__ __forceinline__ int xrs_k_index(int j) {
  const int kb = j >> 4, h = (j >> 3) & 1, q = (j >> 1) & 3, e = j & 1, jj = 2 * kb + h;
  return 16 * q + (jj & 3) + 4 * e + 8 * (jj >> 2);
}

// out column j (MMA order) of the block's 64 SwiGLU outputs for token t: natural column c = k_index(j), whose gate
// row is 64*(c/32) + c%32 of the tile and its up row 32 further (PackedExperts' interleave); g and u are the
// bf16-rounded GEMM outputs, as in the reference
__device__ __forceinline__ void xrs_swiglu(const void* cs_, int t, int j, float limit, float aw, void* o) {
  const __nv_bfloat16* cs = static_cast<const __nv_bfloat16*>(cs_) + t * (XRS_ROWS + XRS_CS_PAD);
  const int c = xrs_k_index(j), gr = (c >> 5) * 64 + (c & 31);
  float g = __bfloat162float(cs[gr]), u = __bfloat162float(cs[gr + 32]);
  if (limit > 0.f) {
    g = fminf(g, limit);
    u = fmaxf(fminf(u, limit), -limit);
  }
  *static_cast<__nv_bfloat16*>(o) = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u * aw);
}

// two adjacent bf16 of the tile (token t, rows 2c, 2c+1) to o[2c] (o: token t's row of out at the block's rows)
__device__ __forceinline__ void xrs_put_pair(const void* cs_, int t, int c, void* o) {
  const __nv_bfloat16* cs = static_cast<const __nv_bfloat16*>(cs_) + t * (XRS_ROWS + XRS_CS_PAD);
  static_cast<uint32_t*>(o)[c] = *reinterpret_cast<const uint32_t*>(cs + 2 * c);
}
#endif
"""


def cuda_source(block_t: int) -> str:
    return (DEQUANT_SOURCE + _HEAD
            + f"#define XRS_ROWS {ROWS}\n#define XRS_W_BYTES {W_BYTES}\n#define XRS_CS_PAD {CS_PAD}\n"
            + "#if DI3_WGMMA\n" + _wgmma_fn(block_t) + "#endif\n"
            + f"#define XRS_WGMMA_N di3_wgmma_n{block_t}\n" + _MAIN + "#endif\n")


def shared_bytes(block_t: int, k: int, stages: int) -> int:
    """Dynamic shared memory of one block: the stages, then the scales of 128 rows over K (the epilogue tile
    reuses the stages)."""
    stage = W_BYTES + block_t * 128
    assert block_t * (ROWS + CS_PAD) * 2 <= stages * stage, "the epilogue tile fits over the stage slots"
    return stages * stage + ROWS * (k // 32) + 1024  # + the alignment of the stages to 1024 bytes


def build_fp4_expert_gemm(n: int, k: int, epilogue: str, block_t: int = 128, stages: int = STAGES,
                          min_blocks: int = 0):
    """prim_func(a [rows, k] bf16 (K in mma_order), tile_expert [tiles] int32, tile_row [tiles] int32, w [E, n,
    k/2] uint8, s [E, n, k/32] uint8, aw [rows] fp32, out [rows, n | n/2] bf16 (swiglu: in mma_order), limit fp32):
    tile t covers rows tile_row[t] .. + block_t of a, aw and out (the caller's promise: inside rows), all of expert
    tile_expert[t] (-1: an unused entry, whose blocks exit at once); rows, tiles and E dynamic."""
    assert epilogue in ("plain", "swiglu")
    assert block_t in (64, 128) and stages >= 3
    assert n % ROWS == 0 and k % 128 == 0 and (k // 32) % 8 == 0  # an even number of 64-K steps
    n_out = n // 2 if epilogue == "swiglu" else n
    BT, S, NK, SL = block_t, stages, k // 64, k // 32
    smem_bytes = shared_bytes(BT, k, S)
    assert smem_bytes <= 227 * 1024
    if min_blocks == 0:  # two blocks an SM where shared memory holds them: at three (64 tokens) the 85 registers
        # left make ptxas serialise the MMAs (its C7512), and the prefill MoE at 2K tokens ran 6.37 -> 7.02 ms
        # (H100); two leave 128 (127 used at 128 tokens, 96 at 64)
        min_blocks = max(1, min(2, (227 * 1024) // (smem_bytes + 1024)))
    rows, tiles, experts = T.dynamic("rows"), T.dynamic("tiles"), T.dynamic("experts")
    src = cuda_source(BT)

    @T.prim_func
    def fp4_expert_gemm(
        a: T.Tensor((rows, k), "bfloat16"),
        tile_expert: T.Tensor((tiles,), "int32"),
        tile_row: T.Tensor((tiles,), "int32"),
        w: T.Tensor((experts, n, k // 2), "uint8"),
        s: T.Tensor((experts, n, k // 32), "uint8"),
        aw: T.Tensor((rows,), "float32"),
        out: T.Tensor((rows, n_out), "bfloat16"),
        limit: T.float32,
    ):
        with T.Kernel(n // ROWS, tiles, threads=THREADS) as (bx, by):
            T.annotate_min_blocks_per_sm(min_blocks)
            smem = T.alloc_shared((smem_bytes // 4,), "uint32")
            acc = T.alloc_local((BT // 2,), "float32")
            tx = T.get_thread_binding()
            T.import_source(src)
            e = tile_expert[by]
            r0 = tile_row[by]
            if e >= 0:  # expert -1: an unused entry of a list sized by a bound (moe_prefill._tile_lists)
                for i in T.unroll(BT // 2):
                    acc[i] = T.float32(0)
                T.call_extern("handle", f"xrs_mainloop<{BT},{S}>", T.address_of(smem[0]),
                              T.address_of(a[0, 0]), T.cast(r0, "int64") * (k * 2), k * 2,
                              T.address_of(w[e, bx * ROWS, 0]), k // 2,
                              T.address_of(s[e, bx * ROWS, 0]), SL, NK,
                              T.address_of(acc[0]))
                T.call_extern("handle", f"xrs_store_acc<{BT}>", T.address_of(acc[0]), T.address_of(smem[0]))
                if epilogue == "plain":
                    for it in T.unroll(BT * ROWS // 2 // THREADS):
                        u = it * THREADS + tx          # a pair of bf16 (one 32-bit word) of the tile
                        t = u // (ROWS // 2)
                        c = u % (ROWS // 2)
                        T.call_extern("handle", "xrs_put_pair", T.address_of(smem[0]), t, c,
                                      T.address_of(out[r0 + t, bx * ROWS]))
                else:
                    for it in T.unroll(BT * 64 // THREADS):
                        u = it * THREADS + tx
                        t = u // 64
                        j = u % 64
                        T.call_extern("handle", "xrs_swiglu", T.address_of(smem[0]), t, j, limit, aw[r0 + t],
                                      T.address_of(out[r0 + t, bx * 64 + j]))

    return fp4_expert_gemm
