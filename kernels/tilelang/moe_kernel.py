"""Grouped expert GEMM for MoE over FP4 (e2m1, ue8m0 per row x 32) or FP8 (e4m3, ue8m0 per 32x32) weights as
stored (PackedExperts), dequantised straight into wgmma A registers (no bf16 weight tile in shared memory), with a
deep cp.async stream that also carries the activations, and one barrier per K step.

Layout ("swap AB"): each block computes C^T[rows, tokens] = W_tile[rows, K] . X[tokens, K]^T, so the wide weight
dimension fills the wgmma M side (64 rows) and the few tokens of an expert sit on the N side (block_t = 8..64).
Work is described by "slots" (one per distinct expert in the batch, built by moe_prep_kernel): slot s covers
positions [start, start+count) of the expert-sorted assignment list; `rows[pos]` is the token of position pos.
Blocks of empty slots exit at once; a slot with more than block_t tokens loops over token chunks.

Epilogues:
  "swiglu": rows of the tile are [32 gate rows | 32 up rows] (PackedExperts packs them tile-interleaved);
            out[pos, n] = bf16(silu(min(g, L)) * clamp(u, +-L) * aw[pos]) with g, u rounded to bf16 first, as the
            torch reference's bf16 F.linear does.
  "add":    y[rows[pos], n] += float(bf16(acc))  (fp32 atomics: a token's routed experts and the shared expert,
            which may run concurrently on another stream, sum into one zeroed fp32 buffer; with k_splits > 1 each
            split adds its fp32 partial unrounded). The order of those adds is not fixed, so the last bit of a
            token's sum can vary between runs and batches (README, Hopper section: what batch invariance covers).

Why this design (the previous generation, in git history and benchmarks/results/moe_v3_gpu_h200.json, was
1.6-1.9x slower and capped near 65% of HBM bandwidth by shared memory):
  * writing every dequantised weight to shared memory as bf16 for wgmma to read back costs 64 KB of shared traffic
    per 8.5 KB of FP4 streamed, more than the 128 B/clk an SM has at full HBM rate. Here each thread dequantises
    into its own wgmma A fragment (wgmma RS), so shared traffic is the packed bytes (in by cp.async, out by one
    ld.shared) plus the small activation tile.
  * the activations ride in the same cp.async stage as the weights, S-1 steps ahead, instead of a synchronous
    global -> registers -> shared load at the top of every K step.
  * A is double-buffered per 64-K group: the dequant of group g+1 runs while the wgmma of group g is in flight
    (wait_group 1), and the only barrier per step sits where the previous step's wgmmas are already complete.

K order. The dequant bit tricks (dequant.py's e4m3; for e2m1 the same placement with one multiply per pair instead
of two shifts, di3_e2m1x8) yield bf16 pairs (i, i+4) of each 8 consecutive codes. Lane q of a
warp loads 16 consecutive codes of a row (8 bytes FP4, 16 bytes FP8) per 64-K group G and places the 8 pair-words
straight into the A fragment slots of k16 blocks 4G..4G+3 (cute ALayout_64x16: lane q holds columns 2q, 2q+1,
2q+8, 2q+9). The MMA's K order is therefore a permutation of the natural one, inside each 64-K group; the
activation tile is permuted the same way in shared memory (in place, one thread per (token, group), two steps
ahead of use), so the dot product is unchanged. `k_index(kf)` below is the map, used by the CPU model test.

Shared memory per stage slot: packed weights [64, BK/2|BK] (16-byte chunks XOR-swizzled so the per-lane loads are
bank-conflict free), their scales, and the activation tile in the wgmma "interleave" K-major layout (8x16-byte
core matrices, core (kf/8, n/8) at ((kf/8)*(BT/8) + n/8)*128 bytes; descriptor LBO = BT*16 bytes, SBO = 128).
Token columns of the tile that hold no token are never loaded: their MMA columns are garbage and never stored.

Pipeline per K step k (S stages, NG = BK/64 groups of 64 K, one warpgroup per 64 weight rows):
    groups 0, 1 of step k                          (wgmma wait_group 1 before each A buffer is refilled)
    cp.async.wait; barrier                         (weight threads: step k+1's stage landed, S-3 stages stay in
                                                    flight; activation threads: step k+2's landed)
    the activation threads permute step k+2's activations in place + fence.proxy.async; stage k+S-1 issued into
    step k-1's slot (its weights by the weight threads, its activations by the activation threads)
    groups 2.. of step k
Loads are split between the two halves of the block (`load_roles`): the proxy fence is a MEMBAR.ALL.CTA in SASS,
and a thread that executes it with cp.async in flight may wait for them, so the threads that stream the weights
never fence. (Every thread loading both, and waiting for all its loads at each barrier, measured the same on the
H200: 44-50% of copy bandwidth at one token, ~73% at 8-64, so the stage drained there was not the limit.)
On non-Hopper targets (sm_100a lowering, sm_80/89) the same fragments feed mma.sync m16n8k16 instead (identical
A/C register layouts), so the kernel still compiles and is correct there, without the async overlap.

Limits: block_n 64 with threads 128 (one warpgroup; M = 64 is the wgmma tile), or 128 with threads 256 (two
warpgroups, each its 64 rows, sharing the activation tile: warp w dequantises rows 16w.., so the fragment code is
the same); block_t is 8, 16, 32 or 64 (256-K steps of 128 tokens do not fit 4 stages in shared memory; an
8K-token prefill measured 1.1x at most from 128); block_k is 128, 256 or 512 (FP4 rows of a 128-K step are 64 bytes,
4 chunks: their swizzle XORs 2*((row>>1)&1), so the two rows of a 128-byte line and the next two land apart);
num_stages >= 4; k_splits (K split over grid
z, "add" epilogue only); min_blocks (__launch_bounds__). The tile policy (which block_t / block_k / stages per pass)
is moe.py's.

Measured (benchmarks/moe_gpu.py, results in benchmarks/results/, moe_gpu_s16_split_h200 the latest): the whole
MoE op at 50% of copy bandwidth at one token, 73-74% at 8-64, 64% at 256; 5 stages 8-13% slower than 4 (one block
fewer per SM).
"""

import tilelang.language as T

from .dequant import CUDA_SOURCE as DEQUANT_SOURCE

BLOCK_N = 64
THREADS = 128
CS_PAD = 4  # fp32 epilogue tile [BT][64 + 4]: conflict-free stores from the wgmma D layout


def _wgmma_fn(n: int) -> str:
    """m64n{n}k16 bf16 wgmma with A from registers (operand order as cute's MMA_64xNx16_F32BF16BF16_RS)."""
    nd = n // 2
    d_ops = ", ".join(f"%{i}" for i in range(nd))
    a_ops = ", ".join(f"%{nd + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    return (
        f"__device__ __forceinline__ void di3_wgmma_n{n}(const uint32_t* a, uint64_t desc, float* d) {{\n"
        f"  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n\"\n"
        f"    \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 \"\n"
        f"    \"{{{d_ops}}}, {{{a_ops}}}, %{nd + 4}, p, 1, 1, 0;\\n}}\\n\"\n"
        f"    : {outs}\n"
        f"    : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(desc), \"r\"(1));\n"
        f"}}\n"
    )


_HEAD = r"""
#ifndef DEEPINFER_MOE_V3_H
#define DEEPINFER_MOE_V3_H
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DI3_WGMMA 1
#else
#define DI3_WGMMA 0
#endif

__device__ __forceinline__ uint32_t di3_smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte global -> shared copy, L1 bypassed (weights are read once); skipped (no write) when !pred
__device__ __forceinline__ void di3_cp16(void* dst, const void* src, int pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p cp.async.cg.shared.global [%0], [%1], 16;\n}\n"
               :: "r"(di3_smem(dst)), "l"(src), "r"(pred) : "memory");
}
template <int BYTES>
__device__ __forceinline__ void di3_cp_small(void* dst, const void* src, int pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p cp.async.ca.shared.global [%0], [%1], %3;\n}\n"
               :: "r"(di3_smem(dst)), "l"(src), "r"(pred), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void di3_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void di3_cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
// generic-proxy shared writes (the activation permute) -> visible to wgmma's async-proxy reads after a barrier
__device__ __forceinline__ void di3_fence_async() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void di3_wgmma_wait() {
#if DI3_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
#endif
}
// keeps the compiler from moving accumulator reads/writes across the asynchronous wgmma region
__device__ __forceinline__ void di3_fence_regs(float* d, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// rows r0 and r0 + 8's dequantised words (d0, d1: 8 each) into one 64-K group's A fragments a[16] (4 k16 blocks):
// word j of a row holds codes (j&3) + 8*(j>>2) and +4; it goes to k16 block t = j/2, column half j&1
__device__ __forceinline__ void di3_place_a(uint32_t* a, const uint32_t* d0, const uint32_t* d1) {
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    a[4 * t + 0] = d0[2 * t];
    a[4 * t + 1] = d1[2 * t];
    a[4 * t + 2] = d0[2 * t + 1];
    a[4 * t + 3] = d1[2 * t + 1];
  }
}
// bf16x2 2^(s-1), the factor that turns dequant.py's e2m1 * 2^-126 placement into e2m1 * 2^(s-127)
__device__ __forceinline__ uint32_t di3_scale_e2m1(uint32_t s) { return ((s + 126u) << 7) * 0x10001u; }
// dequant.py's di_dq_e2m1x8 (same output, same order [0,4,1,5,2,6,3,7]) with one multiply instead of two shifts
// per pair: (n | n << 16) * (2^6 + 2^12) puts two copies of each nibble at bits 6..9 and 12..15 (no overlap, no
// carry); the mask keeps c2..c0 at bits 6..8 and the sign at bit 15 of each half.
__device__ __forceinline__ void di3_e2m1x8(uint32_t w, uint32_t scale, uint32_t* o) {
  const uint32_t w2 = w >> 8;
  uint32_t v[4];
  v[0] = ((w & 0x000F000Fu) * 4160u) & 0x81C081C0u;   // codes 0, 4
  v[1] = ((w & 0x00F000F0u) * 260u) & 0x81C081C0u;    // codes 1, 5 (already 4 bits up: 2^2 + 2^8)
  v[2] = ((w2 & 0x000F000Fu) * 4160u) & 0x81C081C0u;  // codes 2, 6
  v[3] = ((w2 & 0x00F000F0u) * 260u) & 0x81C081C0u;   // codes 3, 7
  const __nv_bfloat162 sc = *reinterpret_cast<const __nv_bfloat162*>(&scale);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v[i]), sc);
    o[i] = *reinterpret_cast<uint32_t*>(&r);
  }
}

// One token x 64-K unit of the activation tile, in place: natural 16-byte chunks kc = 8G..8G+7 (staged by
// cp.async at core rows kc) -> core row 8G + 4s + c, word q = (x[16q+8s+c], x[16q+8s+c+4]) of the group, the
// order the A fragments were dequantised in.
template <int BT>
__device__ __forceinline__ void di3_permute_x(void* xs_, int n, int G) {
  uint8_t* xs = static_cast<uint8_t*>(xs_);
  constexpr int ROW = (BT / 8) * 128;  // bytes between consecutive core rows (kf/8) of one token
  uint8_t* base = xs + (8 * G * (BT / 8) + n / 8) * 128 + (n % 8) * 16;
  uint4 in[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) in[j] = *reinterpret_cast<const uint4*>(base + j * ROW);
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint32_t o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint4 v = in[2 * q + s];
        const uint32_t lo = (c < 2) ? v.x : v.y, hi = (c < 2) ? v.z : v.w;
        o[q] = __byte_perm(lo, hi, (c & 1) ? 0x7632 : 0x5410);
      }
      *reinterpret_cast<uint4*>(base + (4 * s + c) * ROW) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  di3_fence_async();  // this thread's generic-proxy writes -> wgmma (async proxy), published by the next barrier
}
"""

_GROUP = r"""
// 64-K group G of one stage: each thread dequantises rows r0 = 16*warp + lane/4 and r0 + 8, codes
// [64G + 16q, 64G + 16q + 16) (q = lane % 4), into A buffer BUF, then issues the 4 k16 MMAs of the group.
// FMT 0: e2m1 [64][BKP] + ue8m0 [64][SCB]; FMT 1: e4m3 [64][BKP] + ue8m0 [2][SCB] (32x32 blocks).
template <int FMT, int BT, int BKP, int SCB, int G, int BUF>
__device__ __forceinline__ void di3_group(const void* ws_, const void* ss_, const void* xs_, uint32_t* a_all,
                                          float* acc) {
  const uint8_t* ws = static_cast<const uint8_t*>(ws_);
  const uint8_t* ss = static_cast<const uint8_t*>(ss_);
  const uint8_t* xs = static_cast<const uint8_t*>(xs_);
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid >> 2) & 7, q = tid & 3;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  uint32_t* a = a_all + 16 * BUF;
  uint32_t d0[8], d1[8];
  if (FMT == 0) {
    // logical 16-byte chunk 2G + q/2, half q&1; physical chunk XOR 2*(row&3) on the low 3 bits (rows of 128-K
    // steps, 4 chunks: XOR 2*((row>>1)&1), the two rows sharing a 128-byte line apart)
    const int c = 2 * G + (q >> 1);
    const int cp = BKP == 64 ? (c ^ (2 * ((g >> 1) & 1))) : ((c & ~7) | ((c & 7) ^ (2 * (g & 3))));
    const uint2 p0 = *reinterpret_cast<const uint2*>(ws + r0 * BKP + cp * 16 + 8 * (q & 1));
    const uint2 p1 = *reinterpret_cast<const uint2*>(ws + r1 * BKP + cp * 16 + 8 * (q & 1));
    const uint8_t s0 = ss[r0 * SCB + 2 * G + (q >> 1)];
    const uint8_t s1 = ss[r1 * SCB + 2 * G + (q >> 1)];
    di3_wgmma_wait<1>();  // the wgmma that last read buffer BUF (two groups back) is done
    di3_e2m1x8(p0.x, di3_scale_e2m1(s0), d0);
    di3_e2m1x8(p0.y, di3_scale_e2m1(s0), d0 + 4);
    di3_e2m1x8(p1.x, di3_scale_e2m1(s1), d1);
    di3_e2m1x8(p1.y, di3_scale_e2m1(s1), d1 + 4);
  } else {
    // logical chunk 4G + q; physical chunk XOR 4*(row&1) on the low 3 bits
    const int c = 4 * G + q;
    const int cp = (c & ~7) | ((c & 7) ^ (4 * (g & 1)));
    const uint4 p0 = *reinterpret_cast<const uint4*>(ws + r0 * BKP + cp * 16);
    const uint4 p1 = *reinterpret_cast<const uint4*>(ws + r1 * BKP + cp * 16);
    const uint8_t s = ss[(warp >> 1) * SCB + 2 * G + (q >> 1)];
    di3_wgmma_wait<1>();
    di_dq_e4m3x8(reinterpret_cast<const uint8_t*>(&p0.x), s, d0);
    di_dq_e4m3x8(reinterpret_cast<const uint8_t*>(&p0.z), s, d0 + 4);
    di_dq_e4m3x8(reinterpret_cast<const uint8_t*>(&p1.x), s, d1);
    di_dq_e4m3x8(reinterpret_cast<const uint8_t*>(&p1.z), s, d1 + 4);
  }
  di3_place_a(a, d0, d1);
#if DI3_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  // K-major, no swizzle: start (16-byte units, 14 bits), LBO = BT*16 bytes (next 8 K), SBO = 128 (next 8 tokens);
  // k16 block kb starts (kb*BT*32) bytes further, added to the start field (no carry: shared memory < 256 KB)
  const uint64_t desc0 = ((uint64_t)(128 >> 4) << 32) | ((uint64_t)((BT * 16) >> 4) << 16) |
                         (uint64_t)((di3_smem(xs) >> 4) & 0x3FFF);
#pragma unroll
  for (int t = 0; t < 4; ++t) DI3_WGMMA_N(a + 4 * t, desc0 + (uint64_t)((4 * G + t) * BT * 2), acc);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  // same fragments through mma.sync m16n8k16 (one warp = 16 rows; B pairs read from the same shared layout)
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const uint8_t* xb = xs + (4 * G + t) * (BT * 32);
#pragma unroll
    for (int j = 0; j < BT / 8; ++j) {
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(xb + j * 128 + g * 16 + 4 * q);
      const uint32_t b1 = *reinterpret_cast<const uint32_t*>(xb + (BT / 8) * 128 + j * 128 + g * 16 + 4 * q);
      float* c4 = acc + 4 * j;
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};\n"
                   : "+f"(c4[0]), "+f"(c4[1]), "+f"(c4[2]), "+f"(c4[3])
                   : "r"(a[4 * t]), "r"(a[4 * t + 1]), "r"(a[4 * t + 2]), "r"(a[4 * t + 3]), "r"(b0), "r"(b1));
    }
  }
#endif
}
"""


PROBES = ("", "nodq", "nomma", "nodq_nomma")


def cuda_source(block_t: int, probe: str = "") -> str:
    """Device code for one token-tile width (the wgmma N is a compile-time shape). probe: a timing probe that
    drops the FP4 decode ("nodq": the packed words themselves feed the MMA), the MMAs ("nomma": the fragments feed
    one add each) or both; wrong results, benchmarks only (moe_gpu.py --probes)."""
    assert probe in PROBES, f"probe must be one of {PROBES}, got {probe!r}"
    wg = _wgmma_fn(block_t)
    group = _GROUP
    if "nodq" in probe:  # the packed words and scales themselves as the A fragments: one op a word
        group = _swap(group, "    di3_e2m1x8(p0.x, di3_scale_e2m1(s0), d0);\n", _NODQ)
        for line in ("    di3_e2m1x8(p0.y, di3_scale_e2m1(s0), d0 + 4);\n",
                     "    di3_e2m1x8(p1.x, di3_scale_e2m1(s1), d1);\n",
                     "    di3_e2m1x8(p1.y, di3_scale_e2m1(s1), d1 + 4);\n"):
            group = _swap(group, line, "")
    if "nomma" in probe:  # no MMA: the fragments feed one add each, so their loads and decode stay
        fence = "DI3_WGMMA\n  asm volatile(\"wgmma.fence"
        group = _swap(group, "#if " + fence, _NOMMA + "#elif " + fence)
    return (DEQUANT_SOURCE + _HEAD + "#if DI3_WGMMA\n" + wg + "#endif\n"
            + f"#define DI3_WGMMA_N di3_wgmma_n{block_t}\n" + group + "#undef DI3_WGMMA_N\n#endif\n")


_NODQ = """    for (int i = 0; i < 4; ++i) {
      d0[i] = p0.x + s0; d0[i + 4] = p0.y + i; d1[i] = p1.x + s1; d1[i + 4] = p1.y + i;
    }
"""
_NOMMA = """#if 1
#pragma unroll
  for (int t = 0; t < 16; ++t) acc[t % (BT / 2)] += __uint_as_float(a[t] & 0x00800000u);
"""


def _swap(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def swiglu_bf16(gate, up, limit, weight):
    """TileLang expression of the "swiglu" epilogue on fp32 sums: gate and up rounded to bf16 (as the reference's
    bf16 F.linear), the clamp (limit > 0), silu(gate) * up * the routing weight in fp32, rounded to bf16."""
    g_ = T.cast(T.cast(gate, "bfloat16"), "float32")
    u_ = T.cast(T.cast(up, "bfloat16"), "float32")
    g_ = T.if_then_else(limit > 0, T.min(g_, limit), g_)
    u_ = T.if_then_else(limit > 0, T.max(T.min(u_, limit), -limit), u_)
    return T.cast(g_ * T.sigmoid(g_) * u_ * weight, "bfloat16")


def k_index(kf: int) -> int:
    """Natural K offset (inside its 64-K group) of MMA K position kf: the order both operands are fed in."""
    G, r = divmod(kf, 64)
    kb, col = divmod(r, 16)          # k16 block inside the group, column inside it
    h, rem = divmod(col, 8)          # column half (regs a0/a1 vs a2/a3)
    q, e = divmod(rem, 2)            # lane % 4, element of the bf16 pair
    j = 2 * kb + h                   # dequant word index of the lane's 16 codes
    return 64 * G + 16 * q + (j & 3) + 4 * e + 8 * (j >> 2)


def smem_layout(fmt: str, block_t: int, block_k: int, block_n: int = BLOCK_N):
    """(stage bytes, scale offset, activation offset, weight row bytes, scale row bytes) of one stage slot."""
    bkp = block_k // 2 if fmt == "fp4" else block_k
    scb = block_k // 32
    w_bytes = block_n * bkp
    s_bytes = block_n * scb if fmt == "fp4" else (block_n // 32) * scb
    off_x = -(-(w_bytes + s_bytes) // 128) * 128
    stage = -(-(off_x + block_t * block_k * 2) // 128) * 128
    return stage, w_bytes, off_x, bkp, scb


def load_roles(threads: int) -> tuple[int, int]:
    """(threads issuing the weight loads, first thread of the activation loads and permute) of a block: the first
    half streams the weights and never executes the permute's proxy fence, so it keeps weight stages in flight
    across each step's barrier (the fence is a MEMBAR.ALL.CTA in SASS, which may wait for the thread's in-flight
    cp.async); the second half loads and permutes the activations. (Every thread doing both measured the same on
    the H200, hopper-sessions.md's sixteenth session; this is the one generation.)"""
    return threads // 2, threads // 2


def stage_macros(fmt: str, block_t: int, block_k: int, threads: int = THREADS):
    """The pipeline-stage macros both weight-streaming GEMMs (this one and linear_kernel.py) share, for an
    activation tile of block_t tokens x block_k: `load_x` (the token rows of K step kk into a stage slot; xr < 0: no
    token, zero-filled), `permute` (activations into the wgmma B layout, in place) and `group` (dequantise one 64-K
    group of weights into the A fragments and issue its MMAs). `load_x` and `permute` run on the activation
    threads of `load_roles(threads)`."""
    BT, BK = block_t, block_k
    STAGE, OFF_S, OFF_X, BKP, SCB = smem_layout(fmt, BT, BK, threads // 2)  # a warpgroup per 64 weight rows
    _, X0 = load_roles(threads)
    TX = threads - X0                  # activation threads (a multiple of BT: token tx % BT is the same per thread)
    assert TX % BT == 0 and (BT * BK // 8) % TX == 0, "every activation thread loads the same number of chunks"
    X_IT = BT * BK // 8 // TX          # 16-byte activation chunks per thread and step
    P_UNITS = BT * (BK // 64)          # (token, group) permute units per step
    P_IT = -(-P_UNITS // TX)
    fmt_id = 0 if fmt == "fp4" else 1

    @T.macro
    def load_x(smem, xr, x, tx, kk, base):
        # token n = tx % BT for every iteration: its x row xr (< 0: none) is in a register
        if tx >= X0:
            for it in T.unroll(X_IT):
                kc = it * (TX // BT) + (tx - X0) // BT
                x_off = base + OFF_X + (kc * (BT // 8) + (tx % BT) // 8) * 128 + (tx % 8) * 16
                T.call_extern("handle", "di3_cp16", T.address_of(smem[x_off // 4]),
                              T.address_of(x[T.max(xr, 0), kk * BK + kc * 8]), T.if_then_else(xr >= 0, 1, 0))

    @T.macro
    def permute(smem, xr, tx, slot):
        # unit (token tx % BT, group (it*TX + tx - X0) / BT); tokens without a row are skipped
        if tx >= X0:
            for it in T.unroll(P_IT):
                if (P_UNITS % TX == 0) or (it * TX + tx - X0 < P_UNITS):
                    if xr >= 0:
                        T.call_extern("handle", f"di3_permute_x<{BT}>",
                                      T.address_of(smem[(slot * STAGE + OFF_X) // 4]), tx % BT,
                                      (it * TX + tx - X0) // BT)

    @T.macro
    def group(smem, a, acc, slot, G):
        T.call_extern("handle", f"di3_group<{fmt_id},{BT},{BKP},{SCB},{G},{G % 2}>",
                      T.address_of(smem[(slot * STAGE) // 4]), T.address_of(smem[(slot * STAGE + OFF_S) // 4]),
                      T.address_of(smem[(slot * STAGE + OFF_X) // 4]), T.address_of(a[0]), T.address_of(acc[0]))

    return load_x, permute, group


def k_loop_macro(num_stages: int, n_steps: int, n_groups: int, block_t: int, issue, permute, group,
                 weight_threads: int):
    """The pipelined main loop both weight-streaming GEMMs share, over `n_steps` K steps of `n_groups` 64-K groups
    with `num_stages` cp.async stage slots: prologue (stages 0..S-2 in flight, the activations of steps 0 and 1
    permuted), one barrier per step, then the accumulators stored to `c_s` [tokens, 64 rows]. `issue(smem, xr, x,
    w, ws, p, q, tx, kk, slot)` loads global K step kk into a slot; p, q locate the weight tile (each GEMM reads
    them its own way). weight_threads (load_roles): threads below it load only weights and wait at each
    barrier for the next step's weights alone, the others only activations, for the step two ahead (its permute)."""
    S, NK, NG, BT = num_stages, n_steps, n_groups, block_t

    @T.macro
    def k_loop(smem, a, acc, c_s, xr, x, w, ws, p, q, tx, k_first):
        for s in T.unroll(S - 1):
            if s < NK:
                issue(smem, xr, x, w, ws, p, q, tx, k_first + s, s)
            T.call_extern("handle", "di3_cp_commit")
        T.call_extern("handle", f"di3_cp_wait<{S - 3}>")
        T.sync_threads()
        permute(smem, xr, tx, 0)
        if NK > 1:
            permute(smem, xr, tx, 1)
        T.sync_threads()
        for k in T.serial(NK):
            group(smem, a, acc, k % S, 0)
            group(smem, a, acc, k % S, 1)
            # Past this barrier: step k+1's weights landed (used before the next barrier), step k+2's activations
            # landed (permuted next), and every warp is past step k-1's wgmmas (wait_group 1 in group 1), so the
            # slot of step k-1 is free and step k+2's tile can be permuted. The permute's proxy fence (a MEMBAR in
            # SASS) runs on threads with no cp.async of their own in flight: the activation threads have waited
            # for all theirs at 4 stages, and split weight threads never fence, so they keep step k+2's weights
            # (and from S = 5 more) in flight across the barrier.
            if tx < weight_threads:
                T.call_extern("handle", f"di3_cp_wait<{S - 3}>")
            else:
                T.call_extern("handle", f"di3_cp_wait<{S - 4}>")
            T.sync_threads()
            if k + 2 < NK:
                permute(smem, xr, tx, (k + 2) % S)
            if k + S - 1 < NK:
                issue(smem, xr, x, w, ws, p, q, tx, k_first + k + S - 1, (k + S - 1) % S)
            T.call_extern("handle", "di3_cp_commit")
            if NG > 2:
                group(smem, a, acc, k % S, 2)
                group(smem, a, acc, k % S, 3)
            if NG > 4:
                group(smem, a, acc, k % S, 4)
                group(smem, a, acc, k % S, 5)
                group(smem, a, acc, k % S, 6)
                group(smem, a, acc, k % S, 7)
        T.call_extern("handle", "di3_wgmma_wait<0>")
        T.call_extern("handle", "di3_fence_regs", T.address_of(acc[0]), BT // 2)
        # wgmma D layout (cute CLayout_64xN): acc[i] = (row 16w + g + 8*(i/2%2), token 8*(i/4) + 2q + i%2)
        for i in T.unroll(BT // 2):
            c_s[8 * (i // 4) + 2 * (tx % 4) + i % 2,
                16 * (tx // 32) + (tx // 4) % 8 + 8 * ((i // 2) % 2)] = acc[i]

    return k_loop


def shared_bytes(fmt: str, block_t: int, block_k: int, num_stages: int, block_n: int = BLOCK_N) -> int:
    """Dynamic shared memory of one block (stages + epilogue tile + token rows), for occupancy planning."""
    stage = smem_layout(fmt, block_t, block_k, block_n)[0]
    return num_stages * stage + block_t * (block_n + CS_PAD) * 4 + block_t * 4


def build_grouped_gemm(fmt: str, epilogue: str, n_experts: int, n_rows: int, k_dim: int, block_n: int = 64,
                       block_t: int = 16, block_k: int = 256, threads: int = 128, num_stages: int = 4,
                       gather: bool = True, k_splits: int = 1, min_blocks: int = 0, probe: str = ""):
    """fmt: "fp4" (w [E, N, K/2] uint8, scale [E, N, K/32] uint8) or "fp8" (w [E, N, K] uint8 e4m3 bits, scale
    [E, N/32, K/32] uint8). X is [tokens, K] bf16 read at rows[pos] (gather) or at pos (not gather). k_splits: K
    split over grid z ("add" only); min_blocks: __launch_bounds__ min blocks per SM (0 = from shared memory, capped
    at 4). block_n 64 (one warpgroup, threads 128) or 128 (two warpgroups, threads 256, each its own 64 weight
    rows against the one activation tile: half the activation bytes per weight byte in shared memory, so a block
    of 16+ tokens keeps as many weight bytes in flight per SM as one of 8 tokens at block_n 64). Weights and
    activations are loaded by the two halves of the block (load_roles). probe: cuda_source's timing probes (FP4;
    wrong results)."""
    assert fmt in ("fp4", "fp8") and epilogue in ("swiglu", "add")
    assert not probe or fmt == "fp4", "the probes drop the FP4 decode"
    assert block_n in (64, 128) and threads == 2 * block_n, "a warpgroup per 64 weight rows (the wgmma M)"
    assert block_t in (8, 16, 32, 64) and block_k in (128, 256, 512) and num_stages >= 4
    assert n_rows % block_n == 0 and k_dim % (block_k * k_splits) == 0
    assert k_splits == 1 or epilogue == "add", "split K needs the additive epilogue"
    E, N, K, BT, BK, S = n_experts, n_rows, k_dim, block_t, block_k, num_stages
    NG = BK // 64                      # 64-K groups per step
    NK = K // BK // k_splits           # steps per block
    BN, TH = block_n, threads
    STAGE, OFF_S, OFF_X, BKP, SCB = smem_layout(fmt, BT, BK, BN)
    KP = K // 2 if fmt == "fp4" else K
    CPR = BKP // 16                    # 16-byte weight chunks per row and step
    TW, _ = load_roles(TH)  # threads that load weights
    assert (BN * CPR) % TW == 0
    W_IT = BN * CPR // TW
    CS_LD = BN + CS_PAD
    s_shape = (E, N, K // 32) if fmt == "fp4" else (E, N // 32, K // 32)
    n_out = N // 2 if epilogue == "swiglu" else N
    half = BLOCK_N // 2                # PackedExperts' w13 tiles: 32 gate rows then their 32 up rows, per 64 rows
    round_partial = k_splits == 1
    assert shared_bytes(fmt, BT, BK, S, BN) <= 227 * 1024, "stages and tiles exceed an SM's shared memory"
    if min_blocks == 0:
        min_blocks = max(1, min(4, (227 * 1024) // (shared_bytes(fmt, BT, BK, S, BN) + 1024)))
    src = cuda_source(BT, probe)

    n_x, n_pos, n_slots, n_y = T.dynamic("n_x"), T.dynamic("n_pos"), T.dynamic("n_slots"), T.dynamic("n_y")
    out_dtype = "bfloat16" if epilogue == "swiglu" else "float32"
    out_rows = n_pos if epilogue == "swiglu" else n_y
    load_x, permute, group = stage_macros(fmt, BT, BK, TH)

    @T.macro
    def issue(smem, xr, x, w, ws, e, bx, tx, kk, slot):
        # one stage (global K step kk) into slot: weights and their scales on the weight threads (tx < BN <= TW),
        # the token rows of the activations on the activation threads
        base = slot * STAGE
        if tx < TW:
            for it in T.unroll(W_IT):
                r = (it * TW + tx) // CPR
                cc = (it * TW + tx) % CPR
                if fmt == "fp4" and CPR == 4:  # 128-K steps: 64-byte rows
                    cs = T.bitwise_xor(cc, 2 * ((r // 2) % 2))
                else:
                    cs = (cc // 8) * 8 + T.bitwise_xor(cc % 8, (2 * (r % 4)) if fmt == "fp4" else (4 * (r % 2)))
                T.call_extern("handle", "di3_cp16", T.address_of(smem[(base + r * BKP + cs * 16) // 4]),
                              T.address_of(w[e, bx * BN + r, kk * BKP + cc * 16]), 1)
        if fmt == "fp4":
            if tx < BN:
                T.call_extern("handle", f"di3_cp_small<{SCB}>", T.address_of(smem[(base + OFF_S + tx * SCB) // 4]),
                              T.address_of(ws[e, bx * BN + tx, kk * SCB]), 1)
        else:
            if tx < BN // 32:
                T.call_extern("handle", f"di3_cp_small<{SCB}>", T.address_of(smem[(base + OFF_S + tx * SCB) // 4]),
                              T.address_of(ws[e, bx * (BN // 32) + tx, kk * SCB]), 1)
        load_x(smem, xr, x, tx, kk, base)

    k_loop = k_loop_macro(S, NK, NG, BT, issue, permute, group, TW)

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
        with T.Kernel(N // BN, n_slots, k_splits, threads=TH) as (bx, by, bz):
            T.annotate_min_blocks_per_sm(min_blocks)
            # stage slots as 32-bit words (all offsets are multiples of 4 bytes; a uint8 buffer this size trips
            # TileLang 0.1.15's StorageRewrite on some shapes)
            smem = T.alloc_shared((S * STAGE // 4,), "uint32")
            c_s = T.alloc_shared((BT, CS_LD), "float32")
            row_s = T.alloc_shared((BT,), "int32")
            a = T.alloc_local((32,), "uint32")       # two A buffers of 16 registers
            acc = T.alloc_local((BT // 2,), "float32")
            xr = T.alloc_var("int32", init=-1)
            tx = T.get_thread_binding()
            T.import_source(src)

            e = slot_expert[by]
            cnt = slot_count[by]
            start = slot_start[by]
            k_first = bz * NK

            for c in T.serial(T.ceildiv(cnt, BT)):
                for j in T.Parallel(BT):
                    if gather:
                        row_s[j] = T.if_then_else(c * BT + j < cnt, rows[T.min(start + c * BT + j, n_pos - 1)], -1)
                    else:
                        row_s[j] = T.if_then_else(c * BT + j < cnt, start + c * BT + j, -1)
                for i in T.unroll(BT // 2):
                    acc[i] = T.float32(0)
                T.sync_threads()
                xr = row_s[tx % BT]
                k_loop(smem, a, acc, c_s, xr, x, w, ws, e, bx, tx, k_first)
                T.sync_threads()
                if epilogue == "swiglu":
                    # output column o of the block: 64-row tile o // 32 of it, gate row o % 32 of that tile
                    for it in T.unroll((BN // 2) * BT // TH):
                        if row_s[(it * TH + tx) // (BN // 2)] >= 0:
                            j = (it * TH + tx) // (BN // 2)
                            o = (it * TH + tx) % (BN // 2)
                            r = (o // half) * BLOCK_N + o % half
                            pos = start + c * BT + j
                            out[pos, bx * (BN // 2) + o] = swiglu_bf16(c_s[j, r], c_s[j, r + half], limit, aw[pos])
                else:
                    for it in T.unroll(BN * BT // TH):
                        if row_s[(it * TH + tx) // BN] >= 0:
                            j = (it * TH + tx) // BN
                            i = (it * TH + tx) % BN
                            if round_partial:
                                T.atomic_add(out[rows[start + c * BT + j], bx * BN + i],
                                             T.cast(T.cast(c_s[j, i], "bfloat16"), "float32"))
                            else:
                                T.atomic_add(out[rows[start + c * BT + j], bx * BN + i], c_s[j, i])
                T.sync_threads()

    return grouped_gemm
