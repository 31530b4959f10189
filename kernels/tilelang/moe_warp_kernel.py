"""The routed FP4 expert passes at one token a slot, each warp streaming its own weight rows (decode at
batch 1), the default there since the twenty-ninth session's A/B (`moe.WARP_STREAM`).

Why: at one token the grouped GEMM (moe_kernel.py) moves its weights at ~64% of the bandwidth with its FP4 decode
and MMAs both left out (moe_gpu_b1_probe_s28_h100: 93% at 8 tokens): its 432 blocks fit one wave, each walks its
K steps behind one block barrier a step with ~2 of 4 stages in flight. Here the same FP4 decode feeds the same A
fragments (moe_kernel's di3_e2m1x8 / di3_place_a; `mma.sync m16n8k16` instead of wgmma, whose per-warp A layout is
the same), but each warp streams its 16 rows through a private cp.async ring (S stages of 16 rows x BK/2 bytes +
their scales): ~S-1 stages in flight a warp, a __syncwarp a step instead of a block barrier, and the warps of a
block meet twice: once after the token's activations are staged, once in the epilogue.

    grid (N / 64, n_slots), 128 threads: block (bx, by) = 64-row tile bx of slot by's expert, warp w its rows
    16w..16w+15. For "swiglu" the tile's rows are [32 gate | 32 up] (PackedExperts): warps 0-1 gate, 2-3 up.

Tokens: a slot's positions one at a time (the weights streamed again per token): the launcher takes this kernel at
one token a call, where every slot holds one. The activations of that token are staged in shared memory in the
natural K order; lane (g, q) of a warp reads its 16 columns of each 64-K group and orders them as the decode
orders the codes (moe_kernel.k_index), into the B fragment of column 0; the other 7 columns are zero. Results are
the grouped GEMM's up to the order of the fp32 sums (per 64-K group, then across groups in K order), with the
same epilogues and rounding points.
"""

import tilelang.language as T

from .moe_kernel import _HEAD, DEQUANT_SOURCE, swiglu_bf16

ROWS = 64      # weight rows per block (4 warps x 16)
THREADS = 128
BLOCK_K = 256  # K per stage
STAGES = 5


def stage_bytes(block_k: int = BLOCK_K) -> int:
    """One warp's stage: 16 rows x block_k/2 bytes of e2m1 pairs, then 16 rows x block_k/32 scale bytes."""
    return 16 * (block_k // 2) + 16 * (block_k // 32)


def shared_bytes(k_dim: int, block_k: int = BLOCK_K, stages: int = STAGES) -> int:
    """Four warps' rings, the token's activations (k_dim bf16) and the tile's 64 fp32 results."""
    return 4 * stages * stage_bytes(block_k) + 2 * k_dim + 4 * ROWS


_WARP = r"""
// The token's K activations (bf16) into shared memory, 16 bytes a thread and pass.
template <int K, int TH>
__device__ __forceinline__ void dim_load_x(void* xs, const void* x) {
#pragma unroll
  for (int i = threadIdx.x; i < K / 8; i += TH)
    reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
}

// One warp's stage kk of its 16 rows into ring slot `dst`: the weights as 16-byte chunks (lane l: chunks l, l+32,
// ... of the 16 x BKP bytes), XOR-swizzled as moe_kernel's (physical chunk (c & ~7) | ((c & 7) ^ 2*(row & 3)))
// so the fragment reads below are conflict-free, then the scales (BK/32 bytes a row: lanes 0..15, one row each).
template <int BK>
__device__ __forceinline__ void dim_issue(uint8_t* dst, const uint8_t* w, const uint8_t* s, int k_bytes, int k_sc,
                                          int kk, int lane) {
  constexpr int BKP = BK / 2, CPR = BKP / 16, SCB = BK / 32;
#pragma unroll
  for (int i = 0; i < 16 * CPR / 32; ++i) {
    const int idx = i * 32 + lane, r = idx / CPR, c = idx % CPR;
    const int cs = (c & ~7) | ((c & 7) ^ (2 * (r & 3)));
    di3_cp16(dst + r * BKP + cs * 16, w + (size_t)r * k_bytes + kk * BKP + c * 16, 1);
  }
  if (lane < 16) di3_cp_small<SCB>(dst + 16 * BKP + lane * SCB, s + (size_t)lane * k_sc + kk * SCB, 1);
}

// 64-K group G of a stage: lane (g, q) dequantises rows g and g + 8, codes [64G + 16q, +16), into A fragments, the
// token's same 16 columns (x: natural order, from shared memory) into the B fragment of column 0, then 4 MMAs.
template <int BK>
__device__ __forceinline__ void dim_group(const uint8_t* st, const __nv_bfloat16* xs, int k0, int G, int lane,
                                          float* acc) {
  constexpr int BKP = BK / 2, SCB = BK / 32;
  const int g = lane >> 2, q = lane & 3;
  const int c = 2 * G + (q >> 1);
  const int cp = (c & ~7) | ((c & 7) ^ (2 * (g & 3)));
  const uint2 p0 = *reinterpret_cast<const uint2*>(st + g * BKP + cp * 16 + 8 * (q & 1));
  const uint2 p1 = *reinterpret_cast<const uint2*>(st + (g + 8) * BKP + cp * 16 + 8 * (q & 1));
  const uint8_t s0 = st[16 * BKP + g * SCB + 2 * G + (q >> 1)];
  const uint8_t s1 = st[16 * BKP + (g + 8) * SCB + 2 * G + (q >> 1)];
  uint32_t d0[8], d1[8], a[16];
  di3_e2m1x8(p0.x, di3_scale_e2m1(s0), d0);
  di3_e2m1x8(p0.y, di3_scale_e2m1(s0), d0 + 4);
  di3_e2m1x8(p1.x, di3_scale_e2m1(s1), d1);
  di3_e2m1x8(p1.y, di3_scale_e2m1(s1), d1 + 4);
  di3_place_a(a, d0, d1);
  // the token's columns [k0 + 64G + 16q, +16) as the decode's words: word j = (x[(j&3) + 8(j>>2)], that + 4)
  const uint4 v0 = *reinterpret_cast<const uint4*>(xs + k0 + 64 * G + 16 * q);
  const uint4 v1 = *reinterpret_cast<const uint4*>(xs + k0 + 64 * G + 16 * q + 8);
  const uint32_t in[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
  uint32_t b[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int e = (j & 3) + 8 * (j >> 2);  // even element index: its pair partner is e + 4
    const uint32_t lo = in[e >> 1], hi = in[(e + 4) >> 1];
    b[j] = g == 0 ? __byte_perm(lo, hi, (e & 1) ? 0x7632 : 0x5410) : 0u;  // columns 1..7: no token
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

// The warp's first S - 1 steps into its ring (the weights need nothing of the kernel before this one but the
// expert id: issued before the token's activations are staged).
template <int BK, int S, int NK, int N>
__device__ __forceinline__ void dim_prologue(void* ring_, const void* w_, const void* s_, int e, int row0,
                                             int k_bytes, int k_sc) {
  constexpr int STAGE = 16 * (BK / 2) + 16 * (BK / 32);
  uint8_t* ring = static_cast<uint8_t*>(ring_);
  const uint8_t* w = static_cast<const uint8_t*>(w_) + ((size_t)e * N + row0) * k_bytes;
  const uint8_t* s = static_cast<const uint8_t*>(s_) + ((size_t)e * N + row0) * k_sc;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < S - 1; ++kk) {
    if (kk < NK) dim_issue<BK>(ring + kk * STAGE, w, s, k_bytes, k_sc, kk, lane);
    di3_cp_commit();
  }
}

// The warp's K loop after dim_prologue: NK steps through its S-slot ring; results of rows g and g+8 (column 0)
// in acc[0], acc[2].
template <int BK, int S, int NK, int N>
__device__ __forceinline__ void dim_rows(void* ring_, const void* w_, const void* s_, int e, int row0,
                                         const void* xs_, int k_bytes, int k_sc, float* acc) {
  constexpr int STAGE = 16 * (BK / 2) + 16 * (BK / 32);
  uint8_t* ring = static_cast<uint8_t*>(ring_);
  const uint8_t* w = static_cast<const uint8_t*>(w_) + ((size_t)e * N + row0) * k_bytes;
  const uint8_t* s = static_cast<const uint8_t*>(s_) + ((size_t)e * N + row0) * k_sc;
  const __nv_bfloat16* xs = static_cast<const __nv_bfloat16*>(xs_);
  const int lane = threadIdx.x & 31;
  for (int kk = 0; kk < NK; ++kk) {
    di3_cp_wait<S - 2>();  // this lane's copies of step kk landed ...
    __syncwarp();          // ... and every lane's, visible to the warp
    const uint8_t* st = ring + (kk % S) * STAGE;
#pragma unroll
    for (int G = 0; G < BK / 64; ++G) dim_group<BK>(st, xs, kk * BK, G, lane, acc);
    __syncwarp();  // every lane is past slot (kk % S)'s reads before any refills it (S - 1 steps on)
    if (kk + S - 1 < NK) dim_issue<BK>(ring + ((kk + S - 1) % S) * STAGE, w, s, k_bytes, k_sc, kk + S - 1, lane);
    di3_cp_commit();
  }
}
"""


def build_fp4_warp_gemm(epilogue: str, n_experts: int, n_rows: int, k_dim: int, block_k: int = BLOCK_K,
                        stages: int = STAGES, gather: bool = True):
    """moe_kernel.build_grouped_gemm's arguments and epilogues (FP4 weights, k_splits 1) for one token at a time:
    (x [n_x, K] bf16, rows, aw [n_pos], slot_expert, slot_start, slot_count [n_slots], w [E, N, K/2], ws [E, N,
    K/32], out, limit). gather: the token's row of x is rows[pos] (the up pass), else pos (the down pass, x = h)."""
    assert epilogue in ("swiglu", "add")
    E, N, K, BK, S = n_experts, n_rows, k_dim, block_k, stages
    assert N % ROWS == 0 and K % BK == 0 and BK % 64 == 0 and (BK // 2) % 128 == 0 and S >= 3
    NK = K // BK
    KP, SC = K // 2, K // 32
    STAGE = stage_bytes(BK)
    RING = 4 * S * STAGE
    SMEM = shared_bytes(K, BK, S)
    assert SMEM <= 227 * 1024 and K % 8 == 0
    n_out = N // 2 if epilogue == "swiglu" else N
    n_x, n_pos, n_slots, n_y = T.dynamic("n_x"), T.dynamic("n_pos"), T.dynamic("n_slots"), T.dynamic("n_y")
    out_dtype = "bfloat16" if epilogue == "swiglu" else "float32"
    out_rows = n_pos if epilogue == "swiglu" else n_y
    blocks = max(1, min(8, (227 * 1024) // (SMEM + 1024)))
    src = DEQUANT_SOURCE + _HEAD + "#endif\n" + _WARP

    @T.prim_func
    def fp4_warp_gemm(
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
    ):
        with T.Kernel(N // ROWS, n_slots, threads=THREADS) as (bx, by):
            T.annotate_min_blocks_per_sm(blocks)
            ring = T.alloc_shared((RING // 4,), "uint32")  # 32-bit words (moe_kernel: a uint8 buffer trips TileLang)
            xs = T.alloc_shared((K,), "bfloat16")
            res = T.alloc_shared((ROWS,), "float32")
            acc = T.alloc_local((4,), "float32")
            tx = T.get_thread_binding()
            T.import_source(src)
            e = slot_expert[by]
            start = slot_start[by]
            warp = tx // 32
            warp_rows = (T.address_of(ring[(warp * S * STAGE) // 4]), T.address_of(w[0, 0, 0]),
                         T.address_of(ws[0, 0, 0]), e, bx * ROWS + warp * 16)
            prologue = f"dim_prologue<{BK}, {S}, {NK}, {N}>"
            for c in T.serial(slot_count[by]):
                pos = start + c
                xrow = rows[pos] if gather else pos
                # the warp's first steps in flight while the token's activations are staged
                T.call_extern("handle", prologue, *warp_rows, KP, SC)
                T.call_extern("handle", f"dim_load_x<{K}, {THREADS}>", T.address_of(xs[0]),
                              T.address_of(x[xrow, 0]))  # the token's activations
                for i in T.unroll(4):
                    acc[i] = T.float32(0)
                T.sync_threads()
                # (the warp's rows located inside, in size_t: E x N x K/2 passes 2^31 bytes)
                T.call_extern("handle", f"dim_rows<{BK}, {S}, {NK}, {N}>", *warp_rows, T.address_of(xs[0]), KP, SC,
                              T.address_of(acc[0]))
                # column 0 of the MMA tile: lanes with q == 0 hold rows g (acc[0]) and g + 8 (acc[2])
                if tx % 4 == 0:
                    res[warp * 16 + (tx % 32) // 4] = acc[0]
                    res[warp * 16 + (tx % 32) // 4 + 8] = acc[2]
                T.sync_threads()
                if epilogue == "swiglu":
                    if tx < ROWS // 2:
                        out[pos, bx * (ROWS // 2) + tx] = swiglu_bf16(res[tx], res[tx + ROWS // 2], limit, aw[pos])
                else:
                    if tx < ROWS:
                        T.atomic_add(out[rows[pos], bx * ROWS + tx], T.cast(T.cast(res[tx], "bfloat16"), "float32"))
                T.sync_threads()

    return fp4_warp_gemm
