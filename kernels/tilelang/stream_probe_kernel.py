"""Weight-streaming data paths of the routed FP4 expert passes, loads only (benchmarks/stream_probe_gpu.py): how fast
each way of moving the experts' bytes into shared memory can go at decode, before any FP4 decode or MMA is built on
it. On the H200 the grouped GEMM with its decode and MMAs left out moved the weights at only 76-84% of the copy
bandwidth at 8-64 tokens (moe_gpu_probe_h200.log; the H100 94%): the data path itself, not the math, sets the MoE's
pace there, so a new one is chosen by this probe first.

Every mode reads the same bytes as the routed pass (block (bx, by): rows bx*64.. of slot by's expert, all K, and
those rows' block scales) and folds what lands in shared memory into one word a thread (written out, so nothing is
dropped as dead):

  "block"  all threads cp.async 16 B a chunk, S-stage ring, wait_group + block barrier a step (the grouped GEMM's
           path; 128 threads)
  "warp"   each of 4 warps streams its own 16 rows through a private cp.async ring, __syncwarp a step
           (moe_warp_kernel's path; 128 threads)
  "rows"   a producer warp issues one bulk copy (cp.async.bulk, the TMA engine) a row a stage into an S-stage ring
           behind full / empty mbarriers; 4 consumer warps wait on them (160 threads). Rows land at a pitch of
           BK/2 + 16 bytes, as a math kernel would want them (the fragment reads then conflict-free)
  "tile"   as "rows" with one bulk copy a stage: the stage's 64 x BK/2 bytes read as one contiguous run (the bytes of
           a weight layout tiled by stage at load time; here the block's rows' own bytes in another order)
  "tma2d"  as "rows" with one 2-D tensor copy a stage: the [64 rows x BK/2 bytes] box of the weights as they are laid
           out, 128-byte swizzle (moe_bulk_kernel's producer; the tensor map from tensor_map.py)

The bulk modes load the block's scales once (64 x K/32 bytes, contiguous) beside the first stage; the cp.async modes
load each stage's scale slice with it, as the kernels do.
"""

import tilelang.language as T

from .moe_bulk_kernel import TMA_SOURCE
from .moe_kernel import _HEAD, DEQUANT_SOURCE

MODES = ("block", "warp", "rows", "tile", "tma2d")
ROWS = 64
BAR_BYTES = 1024  # the mbarriers' corner of shared memory; the ring starts past it (1 KB-aligned for the bulk copies)

_PROBE = r"""
// the block's rows of expert e located in size_t (E x N x K/2 passes 2^31 bytes)
#define SP_LOCATE                                                                                  \
  uint8_t* sm = static_cast<uint8_t*>(sm_);                                                        \
  const uint8_t* w = static_cast<const uint8_t*>(w_) + ((size_t)e * NR + row0) * k_bytes;          \
  const uint8_t* s = static_cast<const uint8_t*>(s_) + ((size_t)e * NR + row0) * k_sc;             \
  uint32_t* out = static_cast<uint32_t*>(out_);
__device__ __forceinline__ uint32_t sp_fold(const uint8_t* p, int bytes, int t, int nt) {
  uint32_t a = 0;
  for (int i = t; i < bytes / 16; i += nt) {
    const uint4 v = reinterpret_cast<const uint4*>(p)[i];
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return a;
}

// "block": the grouped GEMM's path (all threads copy, a block barrier a step)
template <int BK, int S, int NK, int NR, int TH>
__device__ void sp_block_mode(void* sm_, const void* w_, const void* s_, int e, int row0, int k_bytes, int k_sc,
                              void* out_) {
  SP_LOCATE
  constexpr int BKP = BK / 2, SCB = BK / 32, STAGE = SP_ROWS * BKP + SP_ROWS * SCB, CPR = BKP / 16;
  const int t = threadIdx.x;
  uint32_t acc = 0;
  auto issue = [&](int kk) {
    uint8_t* dst = sm + (kk % S) * STAGE;
    for (int i = t; i < SP_ROWS * CPR; i += TH) {
      const int r = i / CPR, c = i % CPR;
      di3_cp16(dst + r * BKP + c * 16, w + (size_t)r * k_bytes + kk * BKP + c * 16, 1);
    }
    if (t < SP_ROWS) di3_cp_small<SCB>(dst + SP_ROWS * BKP + t * SCB, s + (size_t)t * k_sc + kk * SCB, 1);
  };
  for (int kk = 0; kk < S - 1; ++kk) { if (kk < NK) issue(kk); di3_cp_commit(); }
  for (int kk = 0; kk < NK; ++kk) {
    di3_cp_wait<S - 2>();
    __syncthreads();
    acc ^= sp_fold(sm + (kk % S) * STAGE, STAGE, t, TH);
    __syncthreads();
    if (kk + S - 1 < NK) issue(kk + S - 1);
    di3_cp_commit();
  }
  out[t] = acc;
}

// "warp": moe_warp_kernel's path (a private ring a warp, 16 rows each)
template <int BK, int S, int NK, int NR>
__device__ void sp_warp_mode(void* sm_, const void* w_, const void* s_, int e, int row0, int k_bytes, int k_sc,
                             void* out_) {
  SP_LOCATE
  constexpr int BKP = BK / 2, SCB = BK / 32, STAGE = 16 * BKP + 16 * SCB, CPR = BKP / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint8_t* ring = sm + warp * S * STAGE;
  w += (size_t)(16 * warp) * k_bytes;
  s += (size_t)(16 * warp) * k_sc;
  uint32_t acc = 0;
  auto issue = [&](int kk) {
    uint8_t* dst = ring + (kk % S) * STAGE;
#pragma unroll
    for (int i = 0; i < 16 * CPR / 32; ++i) {
      const int idx = i * 32 + lane, r = idx / CPR, c = idx % CPR;
      di3_cp16(dst + r * BKP + c * 16, w + (size_t)r * k_bytes + kk * BKP + c * 16, 1);
    }
    if (lane < 16) di3_cp_small<SCB>(dst + 16 * BKP + lane * SCB, s + (size_t)lane * k_sc + kk * SCB, 1);
  };
  for (int kk = 0; kk < S - 1; ++kk) { if (kk < NK) issue(kk); di3_cp_commit(); }
  for (int kk = 0; kk < NK; ++kk) {
    di3_cp_wait<S - 2>();
    __syncwarp();
    acc ^= sp_fold(ring + (kk % S) * STAGE, STAGE, lane, 32);
    __syncwarp();
    if (kk + S - 1 < NK) issue(kk + S - 1);
    di3_cp_commit();
  }
  out[threadIdx.x] = acc;
}

// "rows" / "tile" / "tma2d" (TILE 0 / 1 / 2): a producer warp (warp 4) feeds 4 consumer warps through bulk copies
// and mbarriers
template <int BK, int S, int NK, int NR, int TILE>
__device__ void sp_bulk_mode(void* sm_, const void* w_, const void* s_, int e, int row0, int k_bytes, int k_sc,
                             void* out_, const void* tm) {
  SP_LOCATE
  constexpr int BKP = BK / 2, PITCH = TILE ? BKP : BKP + 16, STAGE = SP_ROWS * PITCH;
  uint64_t* full = reinterpret_cast<uint64_t*>(sm);
  uint64_t* empty = full + S;
  uint64_t* sbar = empty + S;
  uint8_t* ring = sm + SP_BAR;
  uint8_t* scales = ring + S * STAGE;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) { mb_init(full + i, 1); mb_init(empty + i, 4); }
    mb_init(sbar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (!TILE)  // the rows' pads are never copied: zeroed, so the fold sees only the rows' bytes
    for (int i = threadIdx.x; i < S * SP_ROWS; i += 160)
      *reinterpret_cast<uint4*>(ring + (i / SP_ROWS) * STAGE + (i % SP_ROWS) * PITCH + BKP) = make_uint4(0, 0, 0, 0);
  __syncthreads();
  if (warp == 4) {
    if (lane == 0) {
      if (TILE == 2) asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" :: "l"(tm) : "memory");
      mb_expect_tx(sbar, SP_ROWS * k_sc);
      mb_bulk(scales, s, SP_ROWS * k_sc, sbar);
    }
    for (int kk = 0; kk < NK; ++kk) {
      const int st = kk % S;
      if (kk >= S) mb_wait(empty + st, ((kk / S) + 1) & 1);
      uint8_t* dst = ring + st * STAGE;
      if (TILE == 2) {
        if (lane == 0) {
          mb_expect_tx(full + st, STAGE);
          mb_tma2d(dst, tm, kk * BKP, e * NR + row0, full + st);
        }
      } else if (TILE) {
        if (lane == 0) {
          mb_expect_tx(full + st, STAGE);
          mb_bulk(dst, w + (size_t)kk * STAGE, STAGE, full + st);
        }
      } else {
        if (lane == 0) mb_expect_tx(full + st, SP_ROWS * BKP);
        __syncwarp();
        mb_bulk(dst + lane * PITCH, w + (size_t)lane * k_bytes + kk * BKP, BKP, full + st);
        mb_bulk(dst + (lane + 32) * PITCH, w + (size_t)(lane + 32) * k_bytes + kk * BKP, BKP, full + st);
      }
    }
    out[threadIdx.x] = 0;
    return;
  }
  const int t = threadIdx.x;
  mb_wait(sbar, 0);
  uint32_t acc = sp_fold(scales, SP_ROWS * k_sc, t, 128);
  for (int kk = 0; kk < NK; ++kk) {
    const int st = kk % S;
    mb_wait(full + st, (kk / S) & 1);
    acc ^= sp_fold(ring + st * STAGE, STAGE, t, 128);
    __syncwarp();
    if (lane == 0) mb_arrive(empty + st);
  }
  out[t] = acc;
}
"""


def threads(mode: str) -> int:
    return 160 if mode in ("rows", "tile", "tma2d") else 128


def shared_bytes(mode: str, k_dim: int, block_k: int, stages: int) -> int:
    bkp, scb = block_k // 2, block_k // 32
    if mode == "block":
        return stages * (ROWS * bkp + ROWS * scb)
    if mode == "warp":
        return 4 * stages * (16 * bkp + 16 * scb)
    pitch = bkp if mode in ("tile", "tma2d") else bkp + 16
    return BAR_BYTES + stages * ROWS * pitch + ROWS * (k_dim // 32)


def build_stream_probe(mode: str, n_experts: int, n_rows: int, k_dim: int, block_k: int = 256, stages: int = 4):
    """(w [E, N, K/2] uint8, ws [E, N, K/32] uint8, slot_expert [n_slots] int32, out [n_slots, N/64, threads]
    int32 (the folds), tmap [128] uint8 (moe_bulk_kernel.weight_map(w); read by "tma2d" only)): block (bx, by)
    streams rows bx*64.. of expert slot_expert[by] in `mode`."""
    assert mode in MODES and n_rows % ROWS == 0 and k_dim % block_k == 0 and block_k % 256 == 0 and stages >= 3
    E, N, K, BK, S = n_experts, n_rows, k_dim, block_k, stages
    NK, KP, SC = K // BK, K // 2, K // 32
    TH = threads(mode)
    SMEM = shared_bytes(mode, K, BK, S)
    assert SMEM <= 227 * 1024 and (ROWS * SC) % 16 == 0
    blocks = max(1, min(8, (227 * 1024) // (SMEM + 1024)))
    n_slots = T.dynamic("n_slots")
    consts = f"static constexpr int SP_ROWS = {ROWS}, SP_BAR = {BAR_BYTES};\n"
    src = DEQUANT_SOURCE + _HEAD + "#endif\n" + consts + TMA_SOURCE + _PROBE
    call = {"block": f"sp_block_mode<{BK}, {S}, {NK}, {N}, {TH}>", "warp": f"sp_warp_mode<{BK}, {S}, {NK}, {N}>",
            "rows": f"sp_bulk_mode<{BK}, {S}, {NK}, {N}, 0>", "tile": f"sp_bulk_mode<{BK}, {S}, {NK}, {N}, 1>",
            "tma2d": f"sp_bulk_mode<{BK}, {S}, {NK}, {N}, 2>"}[mode]
    bulk = mode in ("rows", "tile", "tma2d")

    @T.prim_func
    def stream_probe(
        w: T.Tensor((E, N, KP), "uint8"),
        ws: T.Tensor((E, N, SC), "uint8"),
        slot_expert: T.Tensor((n_slots,), "int32"),
        out: T.Tensor((n_slots, N // ROWS, TH), "int32"),
        tmap: T.Tensor((128,), "uint8"),
    ):
        with T.Kernel(N // ROWS, n_slots, threads=TH) as (bx, by):
            T.annotate_min_blocks_per_sm(blocks)
            sm = T.alloc_shared((SMEM // 4,), "uint32")
            T.import_source(src)
            e = slot_expert[by]
            args = (T.address_of(sm[0]), T.address_of(w[0, 0, 0]), T.address_of(ws[0, 0, 0]), e, bx * ROWS, KP, SC,
                    T.address_of(out[by, bx, 0]))
            T.call_extern("handle", call, *args, *((T.address_of(tmap[0]),) if bulk else ()))

    return stream_probe
