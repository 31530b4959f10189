"""The window KV of a decode step in one launch: RMSNorm, interleaved partial RoPE and the FP8 window codec's
encode of each new row, its e4m3 codes and ue8m0 scale bytes stored straight into the row of the ring the step
writes (`write_row`). Unfused, the same work is five launches a layer: rms_norm, rope, encode_fp8 and the two
index_copy_ writes of the ring's parts.

Bit for bit the unfused kernels (rowwise_kernel.py), which are bit for bit the torch ops: the same arithmetic in
the same order, each stage's bf16 rounding kept.
* RMSNorm: one block per row, thread t is ATen lane t for t < `lanes` (32..LMAX, a runtime argument: the lane
  count ATen's reduction uses for the launch's row count, rowwise.torch_reduce_lanes), the halving fold in
  shared memory (for 32 lanes the same adds as the warp kernel's shuffles): rowwise_kernel.rms_rstd, the block
  kernel's own macro; then bf16(x * r) and the weight's product rounded to bf16.
* RoPE: the trailing `rope_dim` channels as (even, odd) pairs, cos / sin of fp32(pos) * inv_freq rounded to bf16.
* FP8 encode (block 32 = 8 threads' 4-channel vectors): amax by xor shuffles (a maximum: any order gives the same
  value), ue8m0 scale, e4m3 codes.
"""

import numpy as np
import tilelang.language as T

from .rowwise_kernel import BF16, F32, _ceil_pow2_exp, _e4m3, _e4m3_byte, _pow2, _rms_out, f32, last_pow2, rms_rstd

BLOCK = 32  # channels per scale of the FP8 window codec (cache_formats.Fp8Codec.block)
VEC = 4  # channels a thread holds: ATen's 4-wide reduction vector
FP8_MAX = 448.0


def build_window_kv(dim: int, rope_dim: int):
    """x [rows, dim] bf16 (the wkv projection), weight [dim] bf16, pos [rows] int64, inv_freq [rope_dim / 2] fp32
    -> ring_codes[write_row[r]] (dim e4m3 bytes) and ring_scale[write_row[r]] (dim / 32 ue8m0 bytes) for every
    row r. Rows sharing a write row (the trash row) may land in any order."""
    assert dim % 128 == 0 and rope_dim % 8 == 0 and 0 < rope_dim <= dim
    NV = dim // VEC
    LMAX = min(512, last_pow2(NV))  # threads: ATen's widest lane count for this width
    KMAX = -(-NV // 32)  # vectors a lane sums at the fewest lanes (32)
    PER = -(-NV // LMAX)  # vectors a thread encodes
    G = BLOCK // VEC  # threads per scale block: adjacent lanes of one warp (LMAX is a multiple of 8)
    nope, half = dim - rope_dim, rope_dim // 2
    factor = float(np.float32(1) / np.float32(dim))  # MeanOps factor, as the norm kernels
    floor, recip = f32(1e-4), f32(1.0 / FP8_MAX)
    rows, ring_rows = T.dynamic("rows"), T.dynamic("ring_rows")

    @T.prim_func
    def window_kv(
        x: T.Tensor((rows, dim), BF16),
        w: T.Tensor((dim,), BF16),
        pos: T.Tensor((rows,), "int64"),
        inv_freq: T.Tensor((half,), F32),
        ring_codes: T.Tensor((ring_rows, dim), "uint8"),
        ring_scale: T.Tensor((ring_rows, dim // BLOCK), "uint8"),
        write_row: T.Tensor((rows,), "int64"),
        eps: T.float32,
        lanes: T.int32,
    ):
        with T.Kernel(rows, threads=LMAX) as row:
            t = T.get_thread_binding()
            xr = T.alloc_local((VEC,), BF16)
            wr = T.alloc_local((VEC,), BF16)
            acc = T.alloc_local((VEC,), F32)
            y = T.alloc_local((VEC,), F32)  # each stage's bf16-rounded value, held as fp32
            cr = T.alloc_local((VEC,), "uint8")
            red = T.alloc_shared((LMAX,), F32)
            am = T.alloc_var(F32)
            k2 = T.alloc_var("int32")
            q = T.alloc_var(F32)
            cs = T.alloc_var(F32)
            sn = T.alloc_var(F32)
            r = rms_rstd(x, row, t, lanes, eps, NV, KMAX, factor, xr, acc, red)  # rms_norm_block's statistic
            p = T.cast(pos[row], F32)
            dst = write_row[row]
            for k in T.unroll(PER):
                # threads past the last vector work on a valid one (they join the block's shuffles) and store nothing
                v = T.min(t + k * LMAX, NV - 1)
                for i in T.vectorized(VEC):
                    xr[i] = x[row, v * VEC + i]
                for i in T.vectorized(VEC):
                    wr[i] = w[v * VEC + i]
                for i in T.unroll(VEC):
                    y[i] = T.cast(_rms_out(T.cast(xr[i], F32), r, wr[i], "bf16"), F32)
                if v * VEC >= nope:  # rope_kernel's rotation of the pairs (0, 1) and (2, 3)
                    for j in T.unroll(VEC // 2):
                        f = T.ieee_mul(p, inv_freq[T.min((v * VEC - nope) // 2 + j, half - 1)])
                        cs = T.cast(T.cast(T.cos(f), BF16), F32)
                        sn = T.cast(T.cast(T.sin(f), BF16), F32)
                        e = y[2 * j]
                        od = y[2 * j + 1]
                        y[2 * j] = T.cast(T.cast(T.ieee_sub(T.ieee_mul(e, cs), T.ieee_mul(od, sn)), BF16), F32)
                        y[2 * j + 1] = T.cast(T.cast(T.ieee_add(T.ieee_mul(e, sn), T.ieee_mul(od, cs)), BF16), F32)
                # the FP8 codec's encode (fake_quant "fp8" with encode=True)
                am = T.abs(y[0])
                for i in T.unroll(VEC - 1):
                    am = T.max(am, T.abs(y[i + 1]))
                for s in T.unroll(G.bit_length() - 1):
                    am = T.max(am, T.shfl_xor(am, (G // 2) >> s))
                k2 = _ceil_pow2_exp(T.ieee_mul(T.max(am, T.float32(floor)), T.float32(recip)))
                for i in T.unroll(VEC):
                    q = T.ieee_mul(y[i], _pow2(0 - k2))  # x * 2^-k rounds like x / 2^k
                    q = _e4m3(T.min(T.max(q, T.float32(-FP8_MAX)), T.float32(FP8_MAX)))
                    cr[i] = _e4m3_byte(q)
                if t + k * LMAX < NV:
                    for i in T.vectorized(VEC):
                        ring_codes[dst, v * VEC + i] = cr[i]
                    if v % G == 0:
                        ring_scale[dst, v // G] = T.cast(k2 + 127, "uint8")

    return window_kv
