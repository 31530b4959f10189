"""An mHC site's collapse and the RMSNorm after it in one launch: out = rms_norm(sum_k pre[t, k] * x[t, k, :]) for a
layer's attention or FFN input (and the final norm). Unfused that is two launches, mhc_collapse then rms_norm, and a
[tokens, dim] bf16 round trip through memory between them.

Bit for bit the two kernels: one block per token first collapses the row exactly as mhc_kernel's collapse does (the
same fp32 expression per channel: p0 * x0, then += p_k * x_k, rounded to bf16) into shared memory, then normalises
it as rowwise_kernel's rms_norm_block does (thread t is ATen lane t for t < `lanes`, the lane count ATen's
reduction takes for the call's row count; the halving fold, which for 32 lanes adds as the warp kernel's shuffles:
rowwise_kernel.rms_rstd, the block kernel's own macro).
"""

import numpy as np
import tilelang.language as T

from .rowwise_kernel import BF16, F32, _rms_io, _rms_out, last_pow2, rms_rstd

V8 = 8  # channels of one collapse vector (mhc_collapse's 16-byte loads)
V4 = 4  # channels of ATen's reduction vector


def build_mhc_collapse_norm(hc: int, dim: int, weight: str = "bf16"):
    """x [rows, hc, dim] bf16, pre [rows, hc] fp32, w [dim] (bf16 or fp32) -> out [rows, dim] (bf16, or fp32 for an
    fp32 weight, as rms_norm's output)."""
    assert weight in ("bf16", "fp32") and dim % 128 == 0
    H = hc
    NV8, NV = dim // V8, dim // V4
    LMAX = min(512, last_pow2(NV))  # threads: ATen's widest lane count for this width
    KMAX = -(-NV // 32)  # vectors a lane sums at the fewest lanes (32)
    PER8, PER4 = -(-NV8 // LMAX), -(-NV // LMAX)
    factor = float(np.float32(1) / np.float32(dim))
    w_dtype, out_dtype = _rms_io(weight)
    rows = T.dynamic("rows")

    @T.prim_func
    def mhc_collapse_norm(
        x: T.Tensor((rows, H, dim), BF16),
        pre: T.Tensor((rows, H), F32),
        w: T.Tensor((dim,), w_dtype),
        out: T.Tensor((rows, dim), out_dtype),
        eps: T.float32,
        lanes: T.int32,
    ):
        with T.Kernel(rows, threads=LMAX) as row:
            t = T.get_thread_binding()
            p = T.alloc_local((H,), F32)
            xr = T.alloc_local((H, V8), BF16)
            a = T.alloc_local((V8,), F32)
            o8 = T.alloc_local((V8,), BF16)
            yr = T.alloc_local((V4,), BF16)
            acc = T.alloc_local((V4,), F32)
            wr = T.alloc_local((V4,), w_dtype)
            o = T.alloc_local((V4,), out_dtype)
            y = T.alloc_shared((1, dim), BF16)  # the collapsed row
            red = T.alloc_shared((LMAX,), F32)
            for k in T.unroll(H):
                p[k] = pre[row, k]
            for it in T.unroll(PER8):  # mhc_collapse's arithmetic, a 16-byte vector of each stream
                v = it * LMAX + t
                if v < NV8:
                    for k in T.unroll(H):
                        for i in T.vectorized(V8):
                            xr[k, i] = x[row, k, v * V8 + i]
                    for i in T.unroll(V8):
                        a[i] = p[0] * T.cast(xr[0, i], F32)
                    for k in T.unroll(H - 1):
                        for i in T.unroll(V8):
                            a[i] += p[k + 1] * T.cast(xr[k + 1, i], F32)
                    for i in T.unroll(V8):
                        o8[i] = T.cast(a[i], BF16)
                    for i in T.vectorized(V8):
                        y[0, v * V8 + i] = o8[i]
            T.sync_threads()
            r = rms_rstd(y, 0, t, lanes, eps, NV, KMAX, factor, yr, acc, red)  # rms_norm_block's statistic
            for k in T.unroll(PER4):
                v = t + k * LMAX
                if v < NV:
                    for i in T.vectorized(V4):
                        yr[i] = y[0, v * V4 + i]
                    for i in T.vectorized(V4):
                        wr[i] = w[v * V4 + i]
                    for i in T.unroll(V4):
                        o[i] = _rms_out(T.cast(yr[i], F32), r, wr[i], weight)
                    for i in T.vectorized(V4):
                        out[row, v * V4 + i] = o[i]

    return mhc_collapse_norm
