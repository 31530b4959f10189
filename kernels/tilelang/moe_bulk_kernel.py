"""The routed FP4 expert passes at decode from 2 to `moe.BULK_TOKENS` tokens a call, a slot's tokens (up to
MAX_TOKENS at a time) as the MMA's columns and the weights brought in by the TMA engine's copies.

Why: the grouped GEMM (moe_kernel.py) is paced by its data path on the H200 (the weights at 76-84% of the copy
bandwidth with its decode and MMAs left out, moe_gpu_probe_h200.log), and at one token by a wave too short to
ramp; moe_warp_kernel.py streams a warp's rows through cp.async but walks a slot's tokens one at a time, streaming
the expert again per token. Here one producer warp keeps an S-stage ring full with one tensor copy (TMA, 2-D) of
the block's [64 rows x 128 bytes] weight box a stage and one bulk copy per token for the stage's activation slice,
behind full / empty mbarriers, while 4 math warps decode and multiply; every token of a chunk is a column of the
same MMAs, so an expert's weights stream once per chunk. The data-path probe chose the copy (H100,
stream_probe_gpu_s40_h100, stream_probe_gpu_tma2d_s42_h100): one 8 KB copy a stage moved 99-103% of the copy
bandwidth from 8 tokens (the 2-D box of the layout as it is, as a contiguous stage would) where a bulk copy a row
(this kernel's first producer: 30% in the op) moved 62-89%, and 33-41% at 8 stages. What paces the kernel is then
its math warps' decode: 4 blocks an SM (16 math warps) run the op at 93-97% of the bandwidth from 8 to 64 tokens
where 2 ran it at 71-75% (one H100, moe_gpu_bulk_arms_s42_h100).

    grid (N / 64, n_slots), 160 threads: block (bx, by) = rows bx*64.. of slot by's expert. Warps 0-3 (math): warp
    w owns rows 16w..16w+15, lane (g, q) rows g and g + 8 of them and token column g (mma.sync m16n8k16). Warp 4:
    the producer. For "swiglu" a tile's rows are [32 gate | 32 up] (PackedExperts): warps 0-1 gate, 2-3 up.

Shared memory: the mbarriers; S stages of [the weights' 64 x 128-byte box, 128-byte swizzled (chunk c of row r at
c ^ (r & 7): the fragment reads take the fewest wavefronts) | MT tokens x BK bf16], each 1 KB-aligned; the block's
scales (64 rows x K/32, one bulk copy at the start); 64 x 8 fp32 results. The ring runs on across a slot's chunks.
The tensor map (weight_map) is encoded once per weight tensor and read from device memory.

Per token, the sums are moe_warp_kernel's: the same FP4 decode into the same A fragments, the token's 16 columns
of each 64-K group in the decode's order as its B column, fp32 accumulation per 64-K group in K order, and the same
epilogues and rounding points. A token's result does not depend on which column or chunk it is in, nor on the
other tokens (the MMA's columns are independent), so it is bitwise moe_warp_kernel's at one token a slot.
"""

import tilelang.language as T

from .moe_kernel import _HEAD, DEQUANT_SOURCE

ROWS = 64          # weight rows per block (4 math warps x 16)
THREADS = 160      # 4 math warps + 1 producer warp
BLOCK_K = 256      # K per stage
# beyond one token a call: 3 stages of 8 tokens' slices (49 KB at K 5120: 4 blocks an SM). The op at 8 / 64 / 256
# tokens a call (a touched expert's slot holds 1-2 / 1-5 / 1-11 tokens; one H100, moe_gpu_bulk_beyond64_s43_h100),
# against the grouped GEMM's ~325 / ~1700 / ~2940 us: 4 stages of 4 (s42's default) 312 / 1617 / 3512 us, 3 of 8
# 307 / 1611 / 2731, 4 of 8 326 / 1687 / 2854; at 384 (DSpark's verification at B=64) 3 of 8 3203 against 3159. The
# 40-layer step at 4K with 3 of 8: B=256 152.44 -> 140.03 ms, B=8 and 64 within the run-to-run spread of 4 of 4
# (decode_gpu_flash40_bulk38_s43_h100.log); s42's arms: 6 of 8 (2 blocks an SM) lost at 8 and 64
STAGES = 3
MAX_TOKENS = 8     # tokens per chunk (up to the MMA's 8 columns; config(): 1 at one token a call)
BAR_BYTES = 1024   # the mbarriers' corner; the ring starts past it


def stage_bytes(block_k: int = BLOCK_K, max_tokens: int = MAX_TOKENS) -> int:
    """One stage: the weights' [64 x block_k/2] box (128-byte swizzle), then max_tokens x block_k bf16, rounded up to
    1 KB (a swizzled box lands 1 KB-aligned)."""
    return -(-(ROWS * (block_k // 2) + max_tokens * block_k * 2) // 1024) * 1024


def shared_bytes(k_dim: int, block_k: int = BLOCK_K, stages: int = STAGES, max_tokens: int = MAX_TOKENS) -> int:
    # the results: 8 columns whatever max_tokens (the MMA's C fragment has them all)
    return BAR_BYTES + stages * stage_bytes(block_k, max_tokens) + ROWS * (k_dim // 32) + ROWS * 8 * 4


# mbarriers and the TMA engine's copies (bulk: contiguous bytes; tensor: a 2-D box through a tensor map), shared with
# stream_probe_kernel.py
TMA_SOURCE = r"""
__device__ __forceinline__ void mb_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(di3_smem(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(di3_smem(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mb_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(di3_smem(b)) : "memory");
}
__device__ __forceinline__ void mb_wait(uint64_t* b, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(di3_smem(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void mb_bulk(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               :: "r"(di3_smem(dst)), "l"(src), "r"(bytes), "r"(di3_smem(bar)) : "memory");
}
// a [64 rows x BK/2 bytes] box of the weights (tensor map `tm`: the [E x N, K/2] bytes, 128-byte swizzle) at byte
// column c0, row c1
__device__ __forceinline__ void mb_tma2d(void* dst, const void* tm, int c0, int c1, uint64_t* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
               "[%4];\n" :: "r"(di3_smem(dst)), "l"(tm), "r"(c0), "r"(c1), "r"(di3_smem(bar)) : "memory");
}
"""

_BULK = r"""
// the math warps' own barrier (the producer warp never joins one after the start)
__device__ __forceinline__ void mb_math_sync() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }

// 64-K group G of a stage for one math warp: lane (g, q) dequantises rows g and g + 8 (codes [64G + 16q, +16))
// into A fragments, token g's same 16 columns (natural order, from the stage's activation slice) into the B
// fragment of column g, then 4 MMAs. w: the warp's 16 rows of the stage; sc: their scales at this stage's K.
template <int BK, int SC>
__device__ __forceinline__ void mb_group(const uint8_t* w, const uint8_t* sc, const __nv_bfloat16* xs, int G, int g,
                                         int q, int nt, float* acc) {
  constexpr int BKP = BK / 2;
  const int c = 2 * G + (q >> 1);
  const int cs = c ^ g;  // the 128-byte swizzle: chunk c of box row r at c ^ (r & 7); rows g and g + 8 alike
  const uint2 p0 = *reinterpret_cast<const uint2*>(w + g * BKP + cs * 16 + 8 * (q & 1));
  const uint2 p1 = *reinterpret_cast<const uint2*>(w + (g + 8) * BKP + cs * 16 + 8 * (q & 1));
  const uint8_t s0 = sc[g * SC + c];
  const uint8_t s1 = sc[(g + 8) * SC + c];
  uint32_t d0[8], d1[8], a[16];
  di3_e2m1x8(p0.x, di3_scale_e2m1(s0), d0);
  di3_e2m1x8(p0.y, di3_scale_e2m1(s0), d0 + 4);
  di3_e2m1x8(p1.x, di3_scale_e2m1(s1), d1);
  di3_e2m1x8(p1.y, di3_scale_e2m1(s1), d1 + 4);
  di3_place_a(a, d0, d1);
  uint32_t b[8];
  if (g < nt) {
    // token g's columns [64G + 16q, +16) as the decode's words: word j = (x[(j&3) + 8(j>>2)], that + 4)
    const __nv_bfloat16* xg = xs + g * BK + 64 * G + 16 * q;
    const uint4 v0 = *reinterpret_cast<const uint4*>(xg);
    const uint4 v1 = *reinterpret_cast<const uint4*>(xg + 8);
    const uint32_t in[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e = (j & 3) + 8 * (j >> 2);  // even element index: its pair partner is e + 4
      b[j] = __byte_perm(in[e >> 1], in[(e + 4) >> 1], (e & 1) ? 0x7632 : 0x5410);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = 0u;  // no token in this column
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[4 * t]), "r"(a[4 * t + 1]), "r"(a[4 * t + 2]), "r"(a[4 * t + 3]), "r"(b[2 * t]),
                   "r"(b[2 * t + 1]));
  }
}

// moe_kernel's "swiglu" epilogue on fp32 sums (its TileLang expression, as lowered): gate and up rounded to bf16,
// the clamp (limit > 0), silu(gate) * up * the routing weight in fp32, rounded to bf16
__device__ __forceinline__ __nv_bfloat16 mb_swiglu(float gate, float up, float limit, float weight) {
  float g = __bfloat162float(__float2bfloat16_rn(gate));
  float u = __bfloat162float(__float2bfloat16_rn(up));
  if (0.0f < limit) { g = min(g, limit); u = max(min(u, limit), limit * -1.0f); }
  return __float2bfloat16_rn(((g * (1.0f / (1.0f + expf(0.0f - g)))) * u) * weight);
}

// One block: rows row0.. of expert e over the slot's `count` positions from `start`, in chunks of MT tokens.
// SWIGLU: out [n_pos, N/2] bf16 (the up pass; x rows gathered by rows[pos]); else out [n_y, N] fp32, each
// position's bf16-rounded row added at rows[pos] (the down pass; x = h, row pos).
template <int BK, int S, int N, int K, int MT, int SWIGLU>
__device__ void mb_block(void* sm_, const void* x_, const int* rows, const float* aw, int e, int start, int count,
                         const void* tm, const void* s_, int row0, void* out_, float limit) {
  constexpr int BKP = BK / 2, SCB = BK / 32, SC = K / 32, NK = K / BK;
  // a stage: the weights' box, then MT activation slices, rounded to the swizzle's 1 KB alignment
  constexpr int WBYTES = SP_ROWS * BKP, STAGE = (WBYTES + MT * BK * 2 + 1023) / 1024 * 1024;
  uint8_t* sm = static_cast<uint8_t*>(sm_);
  uint64_t* full = reinterpret_cast<uint64_t*>(sm);
  uint64_t* empty = full + S;
  uint64_t* sbar = empty + S;
  uint8_t* ring = sm + SP_BAR;
  uint8_t* scales = ring + S * STAGE;
  float* res = reinterpret_cast<float*>(scales + SP_ROWS * SC);
  const uint8_t* s = static_cast<const uint8_t*>(s_) + ((size_t)e * N + row0) * SC;  // size_t: E x N x K/32 rows
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(x_);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (count <= 0) return;  // an empty slot (fewer experts touched than slots): the whole block leaves
  const int chunks = (count + MT - 1) / MT;
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) { mb_init(full + i, 1); mb_init(empty + i, 4); }
    mb_init(sbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == 4) {  // the producer
    if (lane == 0) {
      // the map was written by a copy before this kernel: acquired for the tensor proxy before its first use
      asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" :: "l"(tm) : "memory");
      mb_expect_tx(sbar, SP_ROWS * SC);
      mb_bulk(scales, s, SP_ROWS * SC, sbar);
    }
    int it = 0;
    for (int c = 0; c < chunks; ++c) {
      const int nt = min(MT, count - c * MT);
      const int pos = start + c * MT + lane;
      const int xrow = lane < nt ? (SWIGLU ? rows[pos] : pos) : 0;
      for (int kk = 0; kk < NK; ++kk, ++it) {
        const int st = it % S;
        if (it >= S) mb_wait(empty + st, ((it / S) + 1) & 1);
        uint8_t* dst = ring + st * STAGE;
        if (lane == 0) {
          mb_expect_tx(full + st, SP_ROWS * BKP + nt * BK * 2);
          mb_tma2d(dst, tm, kk * BKP, e * N + row0, full + st);
        }
        __syncwarp();
        if (lane < nt) mb_bulk(dst + WBYTES + lane * BK * 2, x + (size_t)xrow * K + kk * BK, BK * 2, full + st);
      }
    }
    return;
  }
  const int g = lane >> 2, q = lane & 3, t = threadIdx.x;
  mb_wait(sbar, 0);
  int it = 0;
  for (int c = 0; c < chunks; ++c) {
    const int nt = min(MT, count - c * MT);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int kk = 0; kk < NK; ++kk, ++it) {
      const int st = it % S;
      mb_wait(full + st, (it / S) & 1);
      const uint8_t* stage = ring + st * STAGE;
      const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(stage + WBYTES);
#pragma unroll
      for (int G = 0; G < BK / 64; ++G)
        mb_group<BK, SC>(stage + warp * 16 * BKP, scales + warp * 16 * SC + kk * SCB, xs, G, g, q, nt, acc);
      __syncwarp();
      if (lane == 0) mb_arrive(empty + st);  // this warp is done reading the stage
    }
    // C fragment: rows g, g + 8 of the warp's 16, columns 2q, 2q + 1 (all 8, whatever MT: res is 64 x 8)
    const int r = warp * 16 + g;
    res[r * 8 + 2 * q] = acc[0];
    res[r * 8 + 2 * q + 1] = acc[1];
    res[(r + 8) * 8 + 2 * q] = acc[2];
    res[(r + 8) * 8 + 2 * q + 1] = acc[3];
    mb_math_sync();
    if (SWIGLU) {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(out_);
      for (int i = t; i < (SP_ROWS / 2) * nt; i += 128) {
        const int rr = i % (SP_ROWS / 2), j = i / (SP_ROWS / 2), pos = start + c * MT + j;
        out[(size_t)pos * (N / 2) + row0 / 2 + rr] = mb_swiglu(res[rr * 8 + j], res[(rr + SP_ROWS / 2) * 8 + j],
                                                              limit, aw[pos]);
      }
    } else {
      float* out = static_cast<float*>(out_);
      for (int i = t; i < SP_ROWS * nt; i += 128) {
        const int rr = i % SP_ROWS, j = i / SP_ROWS, pos = start + c * MT + j;
        atomicAdd(out + (size_t)rows[pos] * N + row0 + rr, __bfloat162float(__float2bfloat16_rn(res[rr * 8 + j])));
      }
    }
    mb_math_sync();  // the results are read before the next chunk writes them
  }
}
"""


def config(n_tok: int) -> tuple[int, int]:
    """(stages, max_tokens) at n_tok tokens a call. One token: one token's activation slice a stage and 4 stages,
    so 4 blocks fit an SM and a one-token pass's 432 / 480 blocks one wave; more: STAGES and MAX_TOKENS."""
    return (4, 1) if n_tok == 1 else (STAGES, MAX_TOKENS)


def build_fp4_bulk_gemm(epilogue: str, n_experts: int, n_rows: int, k_dim: int, block_k: int = BLOCK_K,
                        stages: int = STAGES, max_tokens: int = MAX_TOKENS):
    """moe_kernel.build_grouped_gemm's arguments and epilogues (FP4 weights, k_splits 1), then the weights' tensor map:
    (x [n_x, K] bf16, rows, aw [n_pos], slot_expert, slot_start, slot_count [n_slots], w [E, N, K/2], ws [E, N,
    K/32], out, limit, tmap [128] uint8: weight_map(w)).
    "swiglu": x's row of position pos is rows[pos], out [n_pos, N/2] bf16; "add": x = h (row pos), out [n_y, N]
    fp32 added into at rows[pos]. max_tokens: a chunk's tokens (1..8; the stages' activation slices)."""
    assert epilogue in ("swiglu", "add") and 1 <= max_tokens <= 8 and block_k == 256  # 128-byte swizzled rows
    E, N, K, BK, S, MT = n_experts, n_rows, k_dim, block_k, stages, max_tokens
    assert N % ROWS == 0 and K % BK == 0 and BK % 64 == 0 and S >= 2 and (ROWS * (K // 32)) % 16 == 0
    KP, SC = K // 2, K // 32
    SMEM = shared_bytes(K, BK, S, MT)
    assert SMEM <= 227 * 1024
    swiglu = epilogue == "swiglu"
    n_out = N // 2 if swiglu else N
    n_x, n_pos, n_slots, n_y = T.dynamic("n_x"), T.dynamic("n_pos"), T.dynamic("n_slots"), T.dynamic("n_y")
    out_dtype = "bfloat16" if swiglu else "float32"
    out_rows = n_pos if swiglu else n_y
    blocks = max(1, min(8, (227 * 1024) // (SMEM + 1024)))
    consts = f"static constexpr int SP_ROWS = {ROWS}, SP_BAR = {BAR_BYTES};\n"
    src = DEQUANT_SOURCE + _HEAD + "#endif\n" + consts + TMA_SOURCE + _BULK
    call = f"mb_block<{BK}, {S}, {N}, {K}, {MT}, {int(swiglu)}>"

    @T.prim_func
    def fp4_bulk_gemm(
        x: T.Tensor((n_x, K), "bfloat16"),
        rows: T.Tensor((n_pos,), "int32"),
        aw: T.Tensor((n_pos,), "float32"),
        slot_expert: T.Tensor((n_slots,), "int32"),
        slot_start: T.Tensor((n_slots,), "int32"),
        slot_count: T.Tensor((n_slots,), "int32"),
        w: T.Tensor((E, N, KP), "uint8"),
        ws: T.Tensor((E, N, SC), "uint8"),
        out: T.Tensor((out_rows, n_out), out_dtype),
        limit: T.float32,
        tmap: T.Tensor((128,), "uint8"),
    ):
        with T.Kernel(N // ROWS, n_slots, threads=THREADS) as (bx, by):
            T.annotate_min_blocks_per_sm(blocks)
            sm = T.alloc_shared((SMEM // 4,), "uint32")
            T.import_source(src)
            T.call_extern("handle", call, T.address_of(sm[0]), T.address_of(x[0, 0]), T.address_of(rows[0]),
                          T.address_of(aw[0]), slot_expert[by], slot_start[by], slot_count[by],
                          T.address_of(tmap[0]), T.address_of(ws[0, 0, 0]), bx * ROWS, T.address_of(out[0, 0]),
                          limit)

    return fp4_bulk_gemm


def weight_map(w):
    """The tensor map kernels of this module read the weights [E, N, K/2] through: [E x N, K/2] bytes, boxes of
    64 rows x 128 bytes (one 256-K stage of a block's rows), 128-byte swizzle (cached on w)."""
    from .tensor_map import device_map_2d_u8

    return device_map_2d_u8(w, BLOCK_K // 2, ROWS)
