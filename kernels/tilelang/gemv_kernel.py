"""Weight-only FP8 GEMV for a few bf16 activation rows (decode at small batch, DSpark verification at batch 1):
y[t, n] = sum_k x[t, k] * W[n, k], W as e4m3 codes with one ue8m0 scale per 32x32 block (kernels/fp8_weight.py).

Why a second kernel beside linear_kernel.py's wgmma GEMM: at one to eight rows the GEMM's 32-token tile is
mostly empty, every weight byte goes through shared memory and a dequantisation into wgmma fragments, and shapes
with few 64-row tiles split K over extra blocks plus a reduction launch. On the H200 the FP8 projections of a
40-layer B=1 decode step took 3.13 ms for ~5 GB (38% of copy bandwidth), in 210 launches plus 168 reductions
(`decode_gpu_flash40_profiled_h200.log`). Here one warp streams one weight row straight from HBM to registers
(16-byte loads, all of a row's loads unrolled so they are in flight together), decodes e4m3 with the hardware's
conversion, and keeps one fp32 sum per activation row; a butterfly of shuffles adds the 32 lanes in a fixed order.

    grid (N / WARPS, k_splits), WARPS warps a block; warp w of block b owns weight row b * WARPS + w, lane l the
    K columns [c * 32 * VEC + l * VEC, + VEC) of each chunk c of its split.

e4m3 to fp32: `cvt` two codes at a time to f16x2 (exact: e4m3's values, subnormals included, are f16 values),
then f16 to fp32. The first version placed the code's bits into an fp32 by integer ops (~7 a value; the same
values), twice the instructions in PTX (5,426 vs 2,458 for `wo_b` at one row) and 255 registers instead of 186;
on the H200 the conversion took `wq_b` at one row from 20.0 to 15.9 us (61.5% of copy bandwidth) and every other
Flash shape to the same or less (linear_gpu_gemv_cvt_h200.log). The block scale 2^(s - 127) multiplies each
chunk's sum once (exact: a power of two), so the result equals the dense bf16 GEMM on the dequantised weights up to
the order of the fp32 sums, as the GEMM's does.

Rows are independent (a row's sums never see another row's), so a row's result does not depend on how many rows
there are; it differs from the GEMM's in the last bits (another summation order), which is why the launcher never
switches between the two kernels in the batch-invariant mode.
"""

import tilelang.language as T

from .dequant import ue8m0_scale

WARPS = 4  # weight rows per block
M_MAX = (1, 2, 4, 8)  # activation-row variants (each one compile); the launcher picks the smallest that fits


def chunk_width(k_dim: int) -> int:
    """Bytes per lane and chunk: 16 (one 16-byte load) when the K columns are a multiple of 32 x 16, else 8."""
    return 16 if k_dim % 512 == 0 else 8


def build_fp8_gemv(n_rows: int, k_dim: int, m_max: int, k_splits: int = 1, groups: int = 1,
                   weights_before_wait: bool = False):
    """x [m, groups * K] bf16 (m <= m_max), w [N, K] float8_e4m3 (Fp8BlockWeight.weight viewed as
    torch.float8_e4m3fn), ws [N/32, K/32] uint8 (ue8m0) -> out [m, N] bf16 (k_splits == 1) or part
    [k_splits, m, N] fp32 (linear_kernel.build_split_reduce adds them). groups > 1:
    row group g of W (rows [g * N / groups, (g + 1) * N / groups)) multiplies x's columns [g * K, (g + 1) * K).
    weights_before_wait: a programmatic dependent launch (_build.with_pdl) whose wait for the kernel before it
    comes after the weight row's loads are issued, so their HBM latency overlaps that kernel's tail. Only for
    weights no kernel still running may write (a CUDA graph's: the model's weights are fixed once captured)."""
    N, K, G = n_rows, k_dim, groups
    VEC = chunk_width(K)
    CH = 32 * VEC  # K columns a warp covers per chunk
    assert m_max in M_MAX and N % (WARPS * G) == 0 and (N // G) % 32 == 0 and K % (CH * k_splits) == 0
    NC = K // CH // k_splits  # chunks per warp
    rows_per_group = N // G
    partial = k_splits > 1
    m = T.dynamic("m")
    out_shape = (k_splits, m, N) if partial else (m, N)
    out_dtype = "float32" if partial else "bfloat16"

    @T.prim_func
    def fp8_gemv(
        x: T.Tensor((m, G * K), "bfloat16"),
        w: T.Tensor((N, K), "float8_e4m3"),
        ws: T.Tensor((N // 32, K // 32), "uint8"),
        out: T.Tensor(out_shape, out_dtype),
    ):
        with T.Kernel(N // WARPS, k_splits, threads=32 * WARPS) as (bn, bz):
            tx = T.get_thread_binding()
            lane = tx % 32
            n0 = bn * WARPS + tx // 32  # this warp's row
            col0 = (n0 // rows_per_group) * K  # its row's group's first column of x
            wl = T.alloc_local((NC * VEC,), "float8_e4m3")
            wh = T.alloc_local((VEC,), "float16")
            xl = T.alloc_local((VEC,), "bfloat16")
            acc = T.alloc_local((m_max,), "float32")
            d = T.alloc_local((1,), "float32")
            for i in T.unroll(m_max):
                acc[i] = T.float32(0)
            # every load of the warp's row first: NC independent loads in flight per lane
            for c in T.unroll(NC):
                for v in T.vectorized(VEC):
                    wl[c * VEC + v] = w[n0, (bz * NC + c) * CH + lane * VEC + v]
            if weights_before_wait:
                T.pdl_sync()  # the activations (the kernel before's output) only from here
                T.pdl_trigger()
            for c in T.unroll(NC):
                k0 = (bz * NC + c) * CH + lane * VEC
                s = T.cast(ws[n0 // 32, k0 // 32], "int32")
                scale = ue8m0_scale(s)  # 2^(s-127)
                for v in T.vectorized(VEC):  # two codes an instruction (cvt e4m3x2 -> f16x2), exact
                    wh[v] = T.cast(wl[c * VEC + v], "float16")
                for t in T.unroll(m_max):
                    # unconditional loads (a row past m reads the last row again; its sum is never stored): a
                    # load under `if t < m` waits for the branch, and at 8 rows the serial x loads made the GEMV
                    # 4-7x slower than the GEMM (linear_gpu.py, H200)
                    for v in T.vectorized(VEC):
                        xl[v] = x[T.min(t, m - 1), col0 + k0 + v]
                    d[0] = T.float32(0)
                    for v in T.unroll(VEC):
                        d[0] = d[0] + T.cast(wh[v], "float32") * T.cast(xl[v], "float32")
                    acc[t] = acc[t] + d[0] * scale
            for t in T.unroll(m_max):
                for o in T.unroll(5):
                    acc[t] = acc[t] + T.shfl_xor(acc[t], 16 >> o)
                if lane == 0 and t < m:
                    if partial:
                        out[bz, t, n0] = acc[t]
                    else:
                        out[t, n0] = T.cast(acc[t], "bfloat16")

    return fp8_gemv

