"""Routing table for the grouped expert GEMM: one block turns top-k ids into expert-sorted work slots.

Why one tiny kernel rather than torch sort/bincount/cumsum: at decode batch 1 the whole MoE moves ~150 MB
(~35 us at HBM speed); a chain of eight torch launches would add tens of microseconds. Here thread e owns expert
e and scans the ids twice (count, then place), so positions are deterministic (token order inside an expert)
and no atomics are needed.

Outputs (A = tokens * top_k assignments, S = min(E, A) slots):
  rows[pos], aw[pos]   token and routing weight of each assignment, sorted by expert
  slot_expert/start/count[s]  the s-th distinct expert in id order; unused slots get expert -1, count 0
"""

import tilelang.language as T


def build_moe_prep(n_experts: int, top_k: int, chunk: int = 512):
    E, K = n_experts, top_k
    threads = max(128, -(-E // 32) * 32)
    assert threads <= 1024, "one thread per expert"
    n_tok, n_slots = T.dynamic("n_tok"), T.dynamic("n_slots")

    @T.macro
    def load_chunk(ids, idx, c, tx, n_assign):
        # assignments [c * chunk, (c + 1) * chunk) of the flattened ids into shared memory (-1 past the end); both
        # passes read them this way
        T.sync_threads()
        for i in T.serial(chunk // threads + 1):
            a = c * chunk + i * threads + tx
            if i * threads + tx < chunk:
                ids[i * threads + tx] = T.if_then_else(a < n_assign, T.cast(idx[a // K, a % K], "int32"), -1)
        T.sync_threads()

    @T.prim_func
    def moe_prep(
        idx: T.Tensor((n_tok, K), "int64"),
        weights: T.Tensor((n_tok, K), "float32"),
        rows: T.Tensor((n_tok * K,), "int32"),
        aw: T.Tensor((n_tok * K,), "float32"),
        slot_expert: T.Tensor((n_slots,), "int32"),
        slot_start: T.Tensor((n_slots,), "int32"),
        slot_count: T.Tensor((n_slots,), "int32"),
    ):
        with T.Kernel(1, threads=threads) as _:
            ids = T.alloc_shared((chunk,), "int32")
            cnt_s = T.alloc_shared((threads,), "int32")
            tx = T.get_thread_binding()
            n_assign = n_tok * K
            cnt = T.alloc_var("int32", init=0)
            # pass 1: count this thread's expert
            for c in T.serial(T.ceildiv(n_assign, chunk)):
                load_chunk(ids, idx, c, tx, n_assign)
                for i in T.serial(T.min(chunk, n_assign - c * chunk)):  # only the loaded ids (6 at batch 1)
                    if ids[i] == tx:
                        cnt = cnt + 1
            cnt_s[tx] = cnt
            T.sync_threads()
            # exclusive prefix over experts: first position and slot number of this expert, and the slot total
            start = T.alloc_var("int32", init=0)
            slot = T.alloc_var("int32", init=0)
            total_slots = T.alloc_var("int32", init=0)
            for e4 in T.serial(threads // 4):
                for j in T.unroll(4):  # four independent broadcast loads in flight per iteration
                    e = e4 * 4 + j
                    if e < tx:
                        start = start + cnt_s[e]
                        slot = slot + T.if_then_else(cnt_s[e] > 0, 1, 0)
                    total_slots = total_slots + T.if_then_else(cnt_s[e] > 0, 1, 0)
            for s in T.serial(T.ceildiv(n_slots, threads)):
                q = s * threads + tx
                if q < n_slots and q >= total_slots:
                    slot_expert[q] = -1
                    slot_start[q] = 0
                    slot_count[q] = 0
            if cnt > 0:
                slot_expert[slot] = tx
                slot_start[slot] = start
                slot_count[slot] = cnt
            # pass 2: place this expert's assignments in token order
            pos = T.alloc_var("int32", init=0)
            pos = start
            for c in T.serial(T.ceildiv(n_assign, chunk)):
                load_chunk(ids, idx, c, tx, n_assign)
                for i in T.serial(T.min(chunk, n_assign - c * chunk)):
                    if ids[i] == tx:
                        a = c * chunk + i
                        rows[pos] = a // K
                        aw[pos] = weights[a // K, a % K]
                        pos = pos + 1

    return moe_prep
