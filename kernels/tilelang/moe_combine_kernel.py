"""A token's routed expert outputs summed in fp32 in the order given (ascending expert id: the torch reference's
order), then its shared-expert output, rounded to bf16: the last step of the prefill MoE path (moe_prefill.py),
in one pass instead of k gathers, casts and adds over [tokens, hidden] tensors. Bitwise the torch sum
`y = out[rows[:, 0]].float(); y += out[rows[:, j]].float() ...; y += shared.float()` (0 + x is x exactly).
"""

import tilelang.language as T

VEC = 8  # bf16 columns per thread and step: 16-byte loads


def build_moe_combine(hidden: int, k: int, threads: int = 128):
    """prim_func(out [rows, hidden] bf16, tok_rows [tokens, k] int32, shared [tokens, hidden] bf16,
    y [tokens, hidden] bf16); rows and tokens dynamic. One block per token."""
    assert hidden % VEC == 0
    units = hidden // VEC
    rows, tokens = T.dynamic("rows"), T.dynamic("tokens")

    @T.prim_func
    def moe_combine(
        out: T.Tensor((rows, hidden), "bfloat16"),
        tok_rows: T.Tensor((tokens, k), "int32"),
        shared: T.Tensor((tokens, hidden), "bfloat16"),
        y: T.Tensor((tokens, hidden), "bfloat16"),
    ):
        with T.Kernel(tokens, threads=threads) as t:
            tx = T.get_thread_binding()
            acc = T.alloc_local((VEC,), "float32")
            buf = T.alloc_local((VEC,), "bfloat16")
            for it in T.serial(T.ceildiv(units, threads)):
                u = it * threads + tx
                if u < units:
                    for v in T.unroll(VEC):
                        acc[v] = T.float32(0)
                    for j in T.serial(k):
                        for v in T.vectorized(VEC):
                            buf[v] = out[tok_rows[t, j], u * VEC + v]
                        for v in T.unroll(VEC):
                            acc[v] += T.cast(buf[v], "float32")
                    for v in T.vectorized(VEC):
                        buf[v] = shared[t, u * VEC + v]
                    for v in T.unroll(VEC):
                        buf[v] = T.cast(acc[v] + T.cast(buf[v], "float32"), "bfloat16")
                    for v in T.vectorized(VEC):
                        y[t, u * VEC + v] = buf[v]

    return moe_combine
