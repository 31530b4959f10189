"""In-register dequantisation of packed FP4 (e2m1) and FP8 (e4m3) weights to bf16, as CUDA device functions the
TileLang kernels call through `T.call_extern`.

Why bit placement instead of a lookup table or float conversions: the MoE decode GEMMs are bound by HBM
bandwidth only if dequantisation costs ~2 integer ops per weight. Each function turns a 32-bit word of packed
codes into bf16 pairs with two shifts and two masks per pair, and applies the power-of-two block scale with one
bf16x2 multiply (exact: a representable value times 2^k).

* e2m1 nibble [s c2 c1 c0]: placing c at bf16 bits 8..6 (exponent low bits + mantissa msb) and s at bit 15 gives
  exactly e2m1 * 2^-126 for every code, including 0 and 0.5 (bf16 subnormals; bf16 arithmetic keeps subnormals).
  Multiplying by 2^(S-1) (S the ue8m0 byte; bf16 exponent field S+126) yields e2m1 * 2^(S-127). Valid for
  S <= 128 (block scales up to 2: FP4 weights have amax ~0.1, i.e. S ~ 120).
* e4m3 byte [s e3..e0 m2..m0]: shifting the 7 magnitude bits to bf16 bits 10..4 gives e4m3 * 2^-120; times
  2^(S-7) (exponent field S+120) yields e4m3 * 2^(S-127). Valid for S <= 134 (block scales up to 2^7; real
  weights sit near 2^-10, window-KV scales near 2^-6).

All emit elements in one *twiddled* order inside each group of 8 ([0,4,1,5,2,6,3,7]), which is free because the
GEMM permutes the other operand's K index the same way (`fp4_perm`; e4m3 uses the same order, so KV tiles from
both caches share one permutation of the head dim): the dot product is unchanged.
"""

CUDA_SOURCE = r"""
#ifndef DEEPINFER_DEQUANT_H
#define DEEPINFER_DEQUANT_H
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// 8 e2m1 codes (4 bytes, low nibble = even element) -> bf16 in order [0,4,1,5,2,6,3,7], times 2^(s-127).
__device__ __forceinline__ void di_dq_e2m1x8(const uint8_t* src, uint8_t s, void* dst) {
  uint32_t w = *reinterpret_cast<const uint32_t*>(src);
  uint32_t sc = ((uint32_t)s + 126u) << 7;  // bf16 2^(s-1)
  sc |= sc << 16;
  __nv_bfloat162 scale = *reinterpret_cast<__nv_bfloat162*>(&sc);
  uint32_t o[4];
  o[0] = ((w << 6) & 0x01C001C0u) | ((w << 12) & 0x80008000u);
  o[1] = ((w << 2) & 0x01C001C0u) | ((w << 8) & 0x80008000u);
  o[2] = ((w >> 2) & 0x01C001C0u) | ((w << 4) & 0x80008000u);
  o[3] = ((w >> 6) & 0x01C001C0u) | (w & 0x80008000u);
  __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&o[i]), scale);
}

// 8 e4m3 bytes -> bf16 in the same order as e2m1, [0,4,1,5,2,6,3,7], times 2^(s-127). The byte permutes put
// elements (i, i+4) into bytes (0, 2) / (1, 3) of one word so the pair trick below applies.
__device__ __forceinline__ void di_dq_e4m3x8(const uint8_t* src, uint8_t s, void* dst) {
  uint32_t sc = ((uint32_t)s + 120u) << 7;  // bf16 2^(s-7)
  sc |= sc << 16;
  __nv_bfloat162 scale = *reinterpret_cast<__nv_bfloat162*>(&sc);
  __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(dst);
  const uint32_t w0 = reinterpret_cast<const uint32_t*>(src)[0];
  const uint32_t w1 = reinterpret_cast<const uint32_t*>(src)[1];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t w = __byte_perm(w0, w1, h == 0 ? 0x5410 : 0x7632);  // [b0,b1,b4,b5] / [b2,b3,b6,b7]
    uint32_t a = ((w & 0x007F007Fu) << 4) | ((w & 0x00800080u) << 8);   // (b0,b4) / (b2,b6)
    uint32_t b = ((w >> 4) & 0x07F007F0u) | (w & 0x80008000u);          // (b1,b5) / (b3,b7)
    d[2 * h] = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), scale);
    d[2 * h + 1] = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&b), scale);
  }
}

// 16 e2m1 codes (8 bytes) with a real-valued (e4m3) block scale -> bf16 (di_dq_e2m1x8's order in each half), the
// compressed KV cache's rows (e4m3 scale per 16 channels): the codes times 2^126 (exact bf16 values), then times the
// scale (exact: 2 x 4 significant bits fit bf16's 8), the scale converted once for the 16; zeros when !keep (the codes
// times a zero scale: exact zeros of either sign; no code is inf or NaN). Branch-free: a form with one multiply a
// pair where s * 2^126 is a bf16 and a branch to the two steps elsewhere ran the attention kernel 10% slower on an
// H100 (B=2048, one split): the branch split the producer's unrolled rows into blocks ptxas could not interleave.
__device__ __forceinline__ void di_dq_e2m1x16_e4m3(const uint8_t* src, uint8_t s, bool keep, void* dst) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(src);
  __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(dst);
  uint32_t o[8];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    o[4 * h] = ((w[h] << 6) & 0x01C001C0u) | ((w[h] << 12) & 0x80008000u);
    o[4 * h + 1] = ((w[h] << 2) & 0x01C001C0u) | ((w[h] << 8) & 0x80008000u);
    o[4 * h + 2] = ((w[h] >> 2) & 0x01C001C0u) | ((w[h] << 4) & 0x80008000u);
    o[4 * h + 3] = ((w[h] >> 6) & 0x01C001C0u) | (w[h] & 0x80008000u);
  }
  __nv_fp8_e4m3 se = *reinterpret_cast<__nv_fp8_e4m3*>(&s);
  const __nv_bfloat162 scale = __float2bfloat162_rn(keep ? float(se) : 0.0f);
  uint32_t u = (253u << 7) | (253u << 23);  // bf16 2^126 twice: the placed codes (e2m1 * 2^-126) as exact values
  const __nv_bfloat162 up = *reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) d[i] = __hmul2(__hmul2(*reinterpret_cast<__nv_bfloat162*>(&o[i]), up), scale);
}
#endif
"""


def fp4_perm(j):
    """Source K offset of twiddled position j (e2m1): inside each group of 8, [0,4,1,5,2,6,3,7]."""
    return (j // 8) * 8 + (j % 8) // 2 + 4 * (j % 2)


def ue8m0_scale(s):
    """TileLang expression: the fp32 2^(s - 127) of a ue8m0 scale byte s (cast to int32) by bit placement (exact;
    s = 0 is the subnormal 2^-127)."""
    import tilelang.language as T

    return T.reinterpret(T.if_then_else(s > 0, s << 23, T.int32(1 << 22)), "float32")
