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


# ------------------------------------------------------------------------------------- candidate: the streamed GEMV
# The GEMV above holds a whole weight row in registers (wo_b: 256 bytes a lane, ~186 registers), so ~11 warps fit an
# SM and its rows come in waves: each warp's loads land, it multiplies, stores and exits before a new warp loads.
# Below, each warp streams RW rows through its own ring of S shared-memory stages with cp.async (a lane copies and
# later reads back exactly its own 16 bytes of each row and chunk: no barrier, no other lane's data), so S - 1
# chunks of its rows stay in flight while it multiplies, in ~40 registers. Lane l still owns columns l * VEC.. of
# each chunk and a row's sums run in the same order: bitwise the GEMV above. Behind `linear.GEMV_STREAM` until a
# same-machine A/B decides between the two (linear_gpu.py; one generation stays).
STREAM_SOURCE = r"""
#ifndef DEEPINFER_GEMV_STREAM
#define DEEPINFER_GEMV_STREAM
template <int BYTES>
__device__ __forceinline__ void dig_cp(void* dst, const void* src) {
  unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(d), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(d), "l"(src), "n"(BYTES) : "memory");
  }
}
__device__ __forceinline__ void dig_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void dig_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }
#endif
"""
STREAM_ROWS_PER_WARP = 2  # where that still leaves STREAM_MIN_BLOCKS blocks; else one row a warp
STREAM_MIN_BLOCKS = 264   # two an SM on an H100 / H200 (132 SMs)
STREAM_STAGES = 8


def build_fp8_gemv_stream(n_rows: int, k_dim: int, m_max: int, k_splits: int = 1, groups: int = 1,
                          weights_before_wait: bool = False, rows_per_warp: int = 0,
                          stages: int = STREAM_STAGES):
    """build_fp8_gemv's signature and results (bitwise), the weight rows streamed through shared memory: warp w of
    block b owns rows (b * WARPS + w) * RW .. + RW; grid (N / (WARPS * RW), k_splits). rows_per_warp 0: the
    shape's (STREAM_ROWS_PER_WARP where N / (WARPS * it) >= STREAM_MIN_BLOCKS, else 1)."""
    N, K, G = n_rows, k_dim, groups
    RW = rows_per_warp or (STREAM_ROWS_PER_WARP if N // (WARPS * STREAM_ROWS_PER_WARP) >= STREAM_MIN_BLOCKS
                           else 1)
    VEC = chunk_width(K)
    CH = 32 * VEC
    assert m_max in M_MAX and N % (WARPS * RW * G) == 0 and (N // G) % 32 == 0 and K % (CH * k_splits) == 0
    NC = K // CH // k_splits
    S = max(2, min(stages, NC + 1))  # no more slots than chunks (+1: the one being read)
    STAGE = RW * CH  # bytes of one warp's stage: RW rows x one chunk
    rows_per_group = N // G
    partial = k_splits > 1
    m = T.dynamic("m")
    out_shape = (k_splits, m, N) if partial else (m, N)
    out_dtype = "float32" if partial else "bfloat16"

    @T.prim_func
    def fp8_gemv_stream(
        x: T.Tensor((m, G * K), "bfloat16"),
        w: T.Tensor((N, K), "float8_e4m3"),
        ws: T.Tensor((N // 32, K // 32), "uint8"),
        out: T.Tensor(out_shape, out_dtype),
    ):
        with T.Kernel(N // (WARPS * RW), k_splits, threads=32 * WARPS) as (bn, bz):
            T.import_source(STREAM_SOURCE)
            w_s = T.alloc_shared((WARPS * S * STAGE,), "float8_e4m3")
            tx = T.get_thread_binding()
            lane = tx % 32
            ring = (tx // 32) * S * STAGE  # this warp's stages
            n0 = (bn * WARPS + tx // 32) * RW  # its first row; its RW rows share a group (rows_per_group % RW == 0)
            col0 = (n0 // rows_per_group) * K
            wl = T.alloc_local((VEC,), "float8_e4m3")
            wh = T.alloc_local((VEC,), "float16")
            xl = T.alloc_local((m_max, VEC), "bfloat16")
            acc = T.alloc_local((RW * m_max,), "float32")
            d = T.alloc_local((1,), "float32")
            for i in T.unroll(RW * m_max):
                acc[i] = T.float32(0)
            for c in T.unroll(S - 1):  # the first S - 1 chunks of the warp's rows in flight
                if c < NC:
                    for r in T.unroll(RW):
                        T.call_extern("handle", f"dig_cp<{VEC}>",
                                      T.address_of(w_s[ring + c * STAGE + r * CH + lane * VEC]),
                                      T.address_of(w[n0 + r, (bz * NC + c) * CH + lane * VEC]))
                T.call_extern("handle", "dig_commit")
            if weights_before_wait:
                T.pdl_sync()  # the activations (the kernel before's output) only from here
                T.pdl_trigger()
            for c in T.serial(NC):
                T.call_extern("handle", f"dig_wait<{S - 2}>")  # chunk c landed (its group and every older one)
                k0 = (bz * NC + c) * CH + lane * VEC
                for t in T.unroll(m_max):  # the chunk's activations once for the warp's RW rows
                    for v in T.vectorized(VEC):
                        xl[t, v] = x[T.min(t, m - 1), col0 + k0 + v]
                for r in T.unroll(RW):
                    for v in T.vectorized(VEC):
                        wl[v] = w_s[ring + (c % S) * STAGE + r * CH + lane * VEC + v]
                    s = T.cast(ws[(n0 + r) // 32, k0 // 32], "int32")
                    scale = ue8m0_scale(s)
                    for v in T.vectorized(VEC):
                        wh[v] = T.cast(wl[v], "float16")
                    for t in T.unroll(m_max):
                        d[0] = T.float32(0)
                        for v in T.unroll(VEC):
                            d[0] = d[0] + T.cast(wh[v], "float32") * T.cast(xl[t, v], "float32")
                        acc[r * m_max + t] = acc[r * m_max + t] + d[0] * scale
                # the slot read one step ago takes chunk c + S - 1 (its values were used above: no overwrite race)
                if c + S - 1 < NC:
                    for r in T.unroll(RW):
                        T.call_extern("handle", f"dig_cp<{VEC}>",
                                      T.address_of(w_s[ring + ((c + S - 1) % S) * STAGE + r * CH + lane * VEC]),
                                      T.address_of(w[n0 + r, (bz * NC + c + S - 1) * CH + lane * VEC]))
                T.call_extern("handle", "dig_commit")  # an empty group past the end keeps the count
            for r in T.unroll(RW):
                for t in T.unroll(m_max):
                    for o in T.unroll(5):
                        acc[r * m_max + t] = acc[r * m_max + t] + T.shfl_xor(acc[r * m_max + t], 16 >> o)
                    if lane == 0 and t < m:
                        if partial:
                            out[bz, t, n0 + r] = acc[r * m_max + t]
                        else:
                            out[t, n0 + r] = T.cast(acc[r * m_max + t], "bfloat16")

    return fp8_gemv_stream
