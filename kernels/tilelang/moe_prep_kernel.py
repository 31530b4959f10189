"""Routing table for the grouped expert GEMM: one block turns top-k ids into expert-sorted work slots.

Why one tiny kernel rather than torch sort/bincount/cumsum: at decode batch 1 the whole MoE moves ~150 MB
(~35 us at HBM speed); a chain of eight torch launches would add tens of microseconds.

Every thread owns one assignment of a chunk of `threads` (and one expert for the prefix), so the work per thread
is assignments / threads, not assignments (the previous generation had thread e scan every id for expert e: 97 us
a call at 1,536 assignments on the H200). Positions stay deterministic (token order inside an expert) without
ordered atomics: within a chunk, warp w's lanes that chose expert e set their bits of one mask word [w, e] (each
lane its own bit, so the or is the same in any order), and an assignment's place is
    first position of e + e's assignments in earlier chunks (run[e]) + popc(masks of e in earlier warps)
    + popc(mask & lanes below mine).
The counts of pass 1 are shared-memory atomic adds of 1: their sum does not depend on the order either.

Outputs (A = tokens * top_k assignments, S = min(E, A) slots):
  rows[pos], aw[pos]   token and routing weight of each assignment, sorted by expert
  slot_expert/start/count[s]  the s-th distinct expert in id order; unused slots get expert -1, count 0
Ids outside [0, E) (-1: no expert) are left out.

`zero_cols` > 0: the kernel also zeroes `zero` [tokens, zero_cols] fp32 (the MoE's output, which both expert passes
then add into) in blocks of its own beside the table's block: one launch fewer than a separate fill.
"""

import tilelang.language as T


ZERO_PER = 4  # 16-byte zero stores a thread makes in one zeroing block


def build_moe_prep(n_experts: int, top_k: int, zero_cols: int = 0):
    E, K = n_experts, top_k
    threads = max(128, -(-E // 32) * 32)
    assert threads <= 1024, "one thread per expert in the prefix"
    assert zero_cols % 4 == 0
    W = threads // 32
    n_tok, n_slots = T.dynamic("n_tok"), T.dynamic("n_slots")
    ZC = max(zero_cols, 4) // 4  # 16-byte chunks a row of `zero`

    @T.macro
    def table(idx, weights, rows, aw, slot_expert, slot_start, slot_count):
        cnt = T.alloc_shared((threads,), "int32")
        scan = T.alloc_shared((2, 2, threads), "int32")  # [buffer][positions, slots][expert]: the prefix
        run = T.alloc_shared((threads,), "int32")  # next free position of each expert
        mask = T.alloc_shared((W, threads), "uint32")  # [warp][expert]: lanes of the chunk's warp that chose it
        tx = T.get_thread_binding()
        lane = tx % 32
        warp = tx // 32
        n_assign = n_tok * K
        cnt[tx] = 0
        T.sync_threads()
        # pass 1: assignments per expert
        for c in T.serial(T.ceildiv(n_assign, threads)):
            a = c * threads + tx
            if a < n_assign:
                e = T.cast(idx[a // K, a % K], "int32")
                if e >= 0 and e < E:
                    T.atomic_add(cnt[e], 1)
        T.sync_threads()
        # inclusive prefix over experts (Hillis-Steele, double-buffered) of the counts and of "has any"
        my = cnt[tx]
        scan[0, 0, tx] = my
        scan[0, 1, tx] = T.if_then_else(my > 0, 1, 0)
        T.sync_threads()
        for step in T.serial(10):  # 2^10 = 1024 >= threads
            d = 1 << step
            src = step % 2
            if d < threads:
                for v in T.unroll(2):
                    scan[1 - src, v, tx] = scan[src, v, tx] + T.if_then_else(
                        tx >= d, scan[src, v, T.max(tx - d, 0)], 0)
            else:
                for v in T.unroll(2):
                    scan[1 - src, v, tx] = scan[src, v, tx]
            T.sync_threads()
        start = scan[0, 0, tx] - my  # 10 steps: the result is back in buffer 0
        slot = scan[0, 1, tx] - T.if_then_else(my > 0, 1, 0)
        total_slots = scan[0, 1, threads - 1]
        for s in T.serial(T.ceildiv(n_slots, threads)):
            q = s * threads + tx
            if q < n_slots and q >= total_slots:
                slot_expert[q] = -1
                slot_start[q] = 0
                slot_count[q] = 0
        if my > 0:
            slot_expert[slot] = tx
            slot_start[slot] = start
            slot_count[slot] = my
        run[tx] = start
        # pass 2: place each chunk's assignments, in token order inside an expert
        for c in T.serial(T.ceildiv(n_assign, threads)):
            T.sync_threads()  # the previous chunk's reads of mask and run are done
            for w in T.serial(W):
                mask[w, tx] = T.uint32(0)
            T.sync_threads()
            a = c * threads + tx
            e = T.alloc_var("int32", init=-1)
            if a < n_assign:
                e = T.cast(idx[a // K, a % K], "int32")
                if e >= 0 and e < E:
                    # an add of the lane's own bit is an or; TileLang 0.1.15's atomic_or is a global-space
                    # red (it traps on shared memory)
                    T.atomic_add(mask[warp, e], T.shift_left(T.uint32(1), T.cast(lane, "uint32")))
            T.sync_threads()
            if e >= 0 and e < E:
                below = T.shift_left(T.uint32(1), T.cast(lane, "uint32")) - T.uint32(1)
                pos = T.alloc_var("int32", init=0)
                pos = run[e] + T.cast(T.popcount(mask[warp, e] & below), "int32")
                for w in T.serial(W):
                    if w < warp:
                        pos = pos + T.cast(T.popcount(mask[w, e]), "int32")
                rows[pos] = a // K
                aw[pos] = weights[a // K, a % K]
            T.sync_threads()
            p = T.alloc_var("int32", init=0)
            p = run[tx]
            for w in T.serial(W):
                p = p + T.cast(T.popcount(mask[w, tx]), "int32")
            run[tx] = p

    if zero_cols:
        @T.prim_func
        def moe_prep_zero(
            idx: T.Tensor((n_tok, K), "int64"),
            weights: T.Tensor((n_tok, K), "float32"),
            rows: T.Tensor((n_tok * K,), "int32"),
            aw: T.Tensor((n_tok * K,), "float32"),
            slot_expert: T.Tensor((n_slots,), "int32"),
            slot_start: T.Tensor((n_slots,), "int32"),
            slot_count: T.Tensor((n_slots,), "int32"),
            zero: T.Tensor((n_tok * ZC, 4), "float32"),
        ):
            with T.Kernel(1 + T.ceildiv(n_tok * ZC, threads * ZERO_PER), threads=threads) as b:
                if b == 0:
                    table(idx, weights, rows, aw, slot_expert, slot_start, slot_count)
                else:
                    tx = T.get_thread_binding()
                    for it in T.unroll(ZERO_PER):
                        c = ((b - 1) * ZERO_PER + it) * threads + tx
                        if c < n_tok * ZC:
                            for v in T.vectorized(4):
                                zero[c, v] = T.float32(0)

        return moe_prep_zero

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
            table(idx, weights, rows, aw, slot_expert, slot_start, slot_count)

    return moe_prep
