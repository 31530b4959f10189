"""SwiGLU over a GEMM output whose gate and up columns are interleaved as PackedExperts packs w13 (each 64 columns:
32 gate, then the same 32 up): y[t, 32b + j] = bf16(silu(min(g, L)) * clamp(u, -L, L)) with g = h[t, 64b + j], u =
h[t, 64b + 32 + j], in fp32 (L <= 0: no clamp). The shared expert at prefill sizes multiplies its whole w13 in one
GEMM (shared_expert.py); this is the one pass after it, in place of torch's casts, clamps, silu and product.

The same operations as the torch reference (kernels/torch/moe.swiglu_expert: the bf16 GEMM outputs cast to fp32,
clamp, silu as x / (1 + exp(-x)), the product, rounded to bf16), with the accurate expf (no fast math)."""

import tilelang.language as T

VEC = 8     # outputs per thread and step: 16-byte loads of 8 gate and 8 up values (8 divides the 32-column halves)
HALF = 32   # gate (or up) columns per 64-column group: PackedExperts' BLOCK_N // 2


def build_swiglu_halves(inter: int, threads: int = 128):
    """prim_func(h [tokens, 2 * inter] bf16, y [tokens, inter] bf16, limit fp32); tokens dynamic. One block per
    token row."""
    assert inter % HALF == 0
    units = inter // VEC
    tokens = T.dynamic("tokens")

    @T.prim_func
    def swiglu_halves(
        h: T.Tensor((tokens, 2 * inter), "bfloat16"),
        y: T.Tensor((tokens, inter), "bfloat16"),
        limit: T.float32,
    ):
        with T.Kernel(tokens, threads=threads) as t:
            tx = T.get_thread_binding()
            g = T.alloc_local((VEC,), "bfloat16")
            u = T.alloc_local((VEC,), "bfloat16")
            o = T.alloc_local((VEC,), "bfloat16")
            for it in T.serial(T.ceildiv(units, threads)):
                c = (it * threads + tx) * VEC   # the first of this step's output columns
                if c < inter:
                    col = c // HALF * (2 * HALF) + c % HALF
                    for v in T.vectorized(VEC):
                        g[v] = h[t, col + v]
                    for v in T.vectorized(VEC):
                        u[v] = h[t, col + HALF + v]
                    for v in T.unroll(VEC):
                        gf = T.if_then_else(limit > 0, T.min(T.cast(g[v], "float32"), limit), T.cast(g[v], "float32"))
                        uf = T.cast(u[v], "float32")
                        uf = T.if_then_else(limit > 0, T.max(T.min(uf, limit), -limit), uf)
                        o[v] = T.cast(gf / (T.float32(1) + T.exp(-gf)) * uf, "bfloat16")
                    for v in T.vectorized(VEC):
                        y[t, c + v] = o[v]

    return swiglu_halves
