"""FP4 expert weights as stored (e2m1 pairs, low nibble = even column, one ue8m0 scale per row and 32 columns)
dequantised to bf16 rows: the prefill MoE path (moe_prefill.py) turns a chunk of experts into bf16 once per call
and runs them through a grouped tensor-core GEMM, which at hundreds of tokens per expert beats streaming FP4 tiles
per token tile.

The values are exact: e2m1 * 2^(s - 127) has at most 2 significant bits, so fp32 holds the product and bf16 the
rounding of it (the same numbers the torch reference's `dequant_fp4_rows` produces). No special functions: the
magnitude of code c (0..7) is 0, 0.5, 1, 1.5, 2, 3, 4, 6, taken by integer selects; the scale is one exp2
per 32 columns. Each thread reads 8 packed bytes and writes their 16 bf16 values (32-byte stores).
"""

import tilelang.language as T

COLS_PER_THREAD = 16  # bf16 outputs per thread and step: 8 packed bytes


def _e2m1(code):
    """e2m1 code (int32, 0..15) -> fp32 value / 0.5, by integer selects (no table, no exp2): twice the magnitude
    of 0..7 is 0, 1, 2, 3, 4, 6, 8, 12."""
    mag = code & 7
    twice = T.if_then_else(mag < 4, mag, T.if_then_else(mag < 6, 2 * mag - 4, 4 * mag - 16))
    val = T.cast(twice, "float32")
    return T.if_then_else(code >= 8, -val, val)


def build_fp4_rows_dequant(cols: int, threads: int = 256):
    """prim_func(w [rows, cols/2] uint8, s [rows, cols/32] uint8, out [rows, cols] bf16); rows is dynamic.
    One thread per 16-column unit of a row, units of consecutive rows back to back (no idle lanes)."""
    assert cols % 32 == 0
    nb = cols // 2  # packed bytes per row
    per_row = cols // COLS_PER_THREAD  # units per row
    rows = T.dynamic("rows")

    @T.prim_func
    def fp4_rows_dequant(
        w: T.Tensor((rows, nb), "uint8"),
        s: T.Tensor((rows, cols // 32), "uint8"),
        out: T.Tensor((rows, cols), "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(rows * per_row, threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            codes = T.alloc_local((COLS_PER_THREAD // 2,), "uint8")
            vals = T.alloc_local((COLS_PER_THREAD,), "bfloat16")
            scale = T.alloc_local((1,), "float32")
            unit = bx * threads + tx
            r = unit // per_row
            u = unit % per_row
            if r < rows:
                for j in T.vectorized(COLS_PER_THREAD // 2):
                    codes[j] = w[r, u * (COLS_PER_THREAD // 2) + j]
                scale[0] = T.exp2(T.cast(s[r, u // 2], "float32") - 128.0)  # 0.5 * 2^(s - 127)
                for j in T.unroll(COLS_PER_THREAD // 2):
                    b = T.cast(codes[j], "int32")
                    vals[2 * j] = T.cast(_e2m1(b & 15) * scale[0], "bfloat16")
                    vals[2 * j + 1] = T.cast(_e2m1(b >> 4) * scale[0], "bfloat16")
                for j in T.vectorized(COLS_PER_THREAD):
                    out[r, u * COLS_PER_THREAD + j] = vals[j]

    return fp4_rows_dequant
