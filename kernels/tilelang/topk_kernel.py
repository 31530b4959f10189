"""Per-row top-k of the indexer scores (`index_topk`), incl. the two-level candidate blocks, as one TileLang kernel.

One block (512 threads) per query row. Each score becomes an order-preserving uint32 key (sign-flipped fp32 bits,
-0 folded onto +0); entries that cannot be selected (index >= visible, outside the restricting mask, -inf) get key
0. A radix select then finds the rule "take key > thr, plus key == thr with index <= cut":

* the row is read from HBM once: its first `cache` scores land in shared memory by cp.async (one round trip, no
  registers) and become keys in place; the first pass histograms the top 11 key bits into 2048 shared bins on the
  way, and a block-wide suffix scan finds the bin holding the k-th largest key. Passes 2 and 3 refine it on the
  next 11 and 10 bits, reading the keys back from shared memory. A pass whose threshold bin is taken whole ends
  the search: on tie-free scores that is usually pass 2.
* ties on the full key: two more passes on the reversed entry index take the LOWEST indices (torch.topk's tie
  order is unspecified; lowest-index is deterministic and independent of batching).
* fewer selectable entries than k: all of them are taken (thr = 0 matches no key-0 entry).

Emission walks the row in index order, 4 entries per thread per chunk with one block scan, so ids come out
ascending ([S, topk] int32, -1 padded: the `sel` operand of attention.sink_attention_decode) along with, when
asked, the [S, G] mask the registered op returns. The candidate level (candidate source layer) runs next in the
same block: block keys = max member key (the block of entry visible-1 forced to the maximum key) overwrite the key
cache, the same select keeps the best `k_blocks` (lowest block index on ties) and their members form the
candidate mask.

Rows longer than `cache` (16384 entries = 64 KB by default) re-read the rest from global memory (L2-resident
between passes) in every pass; so do block keys past 2 * cache / block_size. Everything that changes per call
(queries, entries, topk, block count, mode) is a symbolic size or scalar argument: one compiled kernel serves all.
"""

import tilelang.language as T

BINS = 2048  # 11-bit digits
SIGN = 0x80000000
NEG_INF_KEY = 0x007FFFFF  # key of -inf; every key at or below it (-inf, negative NaN) is "not selectable"
MAX_KEY = 0xFFFFFFFF  # forced candidate block
TIE_TOP = 0x3FFFFF  # reversed index = TIE_TOP - i (22 bits): larger reversed index = lower entry index
MAX_ENTRIES = TIE_TOP + 1  # the tie passes resolve 22 index bits


def _u(x):
    return T.uint32(x)


def build_index_topk(cache: int = 16384, block_size: int = 8, threads: int = 512, to_rows: bool = False):
    """scores [n_q, n_g] fp32, visible [n_q] int32 -> ids [n_q, n_k] int32 (ascending, -1 padded).

    to_rows: the kernel takes rows_tab [n_b, n_g] int64 (each sequence's pool row of every entry) and seq [n_q]
    int32 (each query's sequence) and writes the selected entries' pool rows rows_tab[seq[q], id] instead of the
    ids (the same order, -1 padded): what the model gathered in six more launches.

    Scalars: use_cand != 0 restricts to cand_in [n_q, n_g] (uint8, nonzero = allowed); write_mask != 0 writes
    sel_mask [n_q, n_g] (uint8 0/1); k_blocks > 0 runs the candidate level and writes cand_out [n_q, n_g]. Unused
    tensors may be [1, 1] dummies (they carry their own symbolic shapes and are never touched)."""
    C, BS, NT = cache, block_size, threads
    assert NT % 32 == 0 and BINS % NT == 0 and C % NT == 0 and C % BS == 0 and 1 <= BS <= 64
    NW, BPT = NT // 32, BINS // NT
    V = 4  # entries per thread per emission chunk (one 128-bit shared load)
    CH = NT * V
    LU = 8  # loads in flight per thread while streaming the row in
    NBM = min(C, 2 * C // BS)  # block keys kept in shared memory (the rest are recomputed from global)
    NBJ = -(-NBM // NT)
    n_q, n_g, n_k = T.dynamic("n_q"), T.dynamic("n_g"), T.dynamic("n_k")
    c_q, c_g, m_q, m_g, o_q, o_g = (T.dynamic(s) for s in ("c_q", "c_g", "m_q", "m_g", "o_q", "o_g"))
    r_b = T.dynamic("r_b")

    # ---- keys -------------------------------------------------------------------------------------------------
    @T.macro
    def order_key(bits, allowed):
        """fp32 bits -> uint32 in the same order (sign-flipped; -0 counts as +0 so that equal scores tie and
        fall to the index rule); 0 = not selectable: -inf (or below) or not allowed."""
        k = T.alloc_var("uint32")
        k = bits
        if k == _u(SIGN):
            k = _u(0)
        k = k ^ ((_u(0) - (k >> 31)) | _u(SIGN))
        if k <= _u(NEG_INF_KEY) or not allowed:
            k = _u(0)
        return k

    @T.macro
    def gkey(scores, cand_in, use_cand, row, i):
        """Key of entry i (< visible) from global memory."""
        ok = T.alloc_var("bool")
        ok = True
        if use_cand != 0:
            # clamped: a [1, 1] dummy is never read out of bounds
            ok = cand_in[T.min(row, c_q - 1), T.min(i, c_g - 1)] != T.uint8(0)
        return order_key(T.reinterpret(scores[row, i], "uint32"), ok)

    @T.macro
    def ekey(kc, scores, cand_in, use_cand, row, n, i):
        """Key of entry i: 0 past the visible count, else from the shared cache or (beyond it) global memory."""
        k = T.alloc_var("uint32")
        k = _u(0)
        if i < n:
            if i < C:
                k = kc[i]
            else:
                k = gkey(scores, cand_in, use_cand, row, i)
        return k

    @T.macro
    def bkey(kc, scores, cand_in, use_cand, row, n, fb, nb, b):
        """Key of candidate block b (after the in-place block pass): cached, or the max member key recomputed."""
        k = T.alloc_var("uint32")
        k = _u(0)
        if b < nb:
            if b < NBM:
                k = kc[b]
            else:
                if b == fb:
                    k = _u(MAX_KEY)
                else:
                    for e in T.serial(BS):
                        k = T.max(k, ekey(kc, scores, cand_in, use_cand, row, n, b * BS + e))
        return k

    def take(k, i, thr, cut):
        return T.if_then_else(k > thr, 1, T.if_then_else(k == thr, T.if_then_else(i <= cut, 1, 0), 0))

    # ---- radix select -----------------------------------------------------------------------------------------
    @T.macro
    def init_state(ist, ust, hist, tx, need):
        # the previous readers of ist/ust/hist finished before the caller's last barrier
        if tx == 0:
            ist[0] = need  # entries still to take inside the current prefix
            ist[1] = 0  # done
            ist[2] = -1  # cut: ties at thr are taken up to this index
            ust[0] = _u(0)  # key prefix found so far
            ust[1] = _u(0)  # thr
            ust[2] = _u(0)  # reversed-index prefix (tie passes)
        for j in T.unroll(BPT):
            hist[tx * BPT + j] = 0
        T.sync_threads()

    @T.macro
    def search(hist, wsum, ist, ust, tx, lane, warp, shift, stage):
        """Find the bin holding the `need`-th largest digit and update the state (behind a barrier). stage: 0 first
        key pass, 1 middle, 2 last key pass, 3 first tie pass, 4 last tie pass."""
        need = T.alloc_var("int32")
        need = ist[0]
        pre0 = T.alloc_var("uint32")
        pre0 = ust[0]
        rpre0 = T.alloc_var("uint32")
        rpre0 = ust[2]
        s = T.alloc_var("int32")
        s = 0
        for j in T.unroll(BPT):
            s = s + hist[tx * BPT + j]
        x = T.alloc_var("int32")
        x = s
        for o in (1, 2, 4, 8, 16):  # inclusive suffix sum over the warp's lanes
            y = T.shfl_down(x, o)
            x = T.if_then_else(lane + o < 32, x + y, x)
        if lane == 0:
            wsum[warp] = x
        T.sync_threads()
        acc = T.alloc_var("int32")
        acc = x - s  # entries in the bins of higher lanes of this warp
        for w in T.unroll(NW):
            acc = acc + T.if_then_else(w > warp, wsum[w], 0)
        fd = T.alloc_var("int32")
        fd = -1
        frest = T.alloc_var("int32")
        frest = 0
        fh = T.alloc_var("int32")
        fh = 0
        for jj in T.unroll(BPT):
            d = tx * BPT + (BPT - 1 - jj)
            h = hist[d]
            if acc < need and acc + h >= need:
                fd = d
                frest = need - acc  # still to take inside bin d
                fh = h
            acc = acc + h
        if fd >= 0:  # exactly one thread
            if stage <= 2:
                pre = T.alloc_var("uint32")
                pre = pre0 | (T.cast(fd, "uint32") << shift)
                if fh == frest:  # bin taken whole: key >= pre
                    ist[1] = 1
                    ust[1] = pre - _u(1)
                    ist[2] = -1
                elif stage == 2:  # the full key is tied: continue on the index
                    ust[1] = pre
                    ist[0] = frest
                else:
                    ust[0] = pre
                    ist[0] = frest
            else:
                rpre = T.alloc_var("uint32")
                rpre = rpre0 | (T.cast(fd, "uint32") << shift)
                if fh == frest or stage == 4:  # indices are unique: the last tie pass always ends here
                    ist[1] = 1
                    ist[2] = T.cast(_u(TIE_TOP) - rpre, "int32")
                else:
                    ust[2] = rpre
                    ist[0] = frest
        if stage == 0 and tx == 0 and acc < need:  # fewer selectable than wanted: take them all
            ist[1] = 1
            ust[1] = _u(0)
            ist[2] = -1
        T.sync_threads()

    @T.macro
    def body(scores, visible, cand_in, ids, sel_mask, cand_out, use_cand, write_mask, k_blocks, rows_tab, seq):
        with T.Kernel(n_q, threads=NT) as row:
            # two rows per SM (<= 64 registers/thread): a 256-query decode batch runs in one wave on 132 SMs
            T.annotate_min_blocks_per_sm(2)
            tx = T.get_thread_binding()
            lane = tx % 32
            warp = tx // 32
            kc = T.alloc_shared((C,), "uint32")
            hist = T.alloc_shared((BINS,), "int32")
            wsum = T.alloc_shared((NW,), "int32")
            esum = T.alloc_shared((2 * NW,), "int32")
            ist = T.alloc_shared((4,), "int32")
            ust = T.alloc_shared((4,), "uint32")
            rawb = T.alloc_local((LU,), "uint32")
            rawc = T.alloc_local((LU,), "uint8")
            kv = T.alloc_local((V,), "uint32")
            tmp = T.alloc_local((BS,), "uint32")
            bm = T.alloc_local((NBJ,), "uint32")

            vis = T.alloc_var("int32")
            vis = visible[row]
            n = T.alloc_var("int32")
            n = T.max(T.min(vis, n_g), 0)
            nb = T.alloc_var("int32")
            nb = T.ceildiv(n_g, BS)
            fb = T.alloc_var("int32")
            fb = T.if_then_else(vis >= 1, (vis - 1) // BS, -1)  # candidate block of the newest visible entry
            # local copies: a symbolic size passed to a macro gets renamed after the macro's parameter
            want = T.alloc_var("int32")
            want = n_k
            want_blocks = T.alloc_var("int32")
            want_blocks = k_blocks

            # ---- stream the row in once: the cached part lands in shared memory by cp.async (one round trip, no
            # registers), is turned into keys in place and histogrammed on its top 11 bits (the first radix pass)
            init_state(ist, ust, hist, tx, want)
            mc = T.alloc_var("int32")
            mc = T.min(n, C)
            for j in T.serial(T.ceildiv(mc, NT)):
                i = j * NT + tx
                if i < mc:
                    T.ptx_cp_async(T.access_ptr(kc[i], "w", 1), T.access_ptr(scores[row, i], "r", 1), 1)
            T.ptx_commit_group()
            T.ptx_wait_group(0)
            for c in T.serial(T.ceildiv(n, NT * LU)):
                for u in T.unroll(LU):  # loads first: LU in flight per thread (mask bytes; scores past the cache)
                    i = (c * LU + u) * NT + tx
                    rawc[u] = T.uint8(1)
                    if i < n:
                        if use_cand != 0:
                            rawc[u] = cand_in[T.min(row, c_q - 1), T.min(i, c_g - 1)]
                        if i >= C:
                            rawb[u] = T.reinterpret(scores[row, i], "uint32")
                for u in T.unroll(LU):
                    i = (c * LU + u) * NT + tx
                    if i < n:
                        k = T.alloc_var("uint32")
                        if i < C:  # each thread converts the entries it copied itself: no barrier needed
                            k = order_key(kc[i], rawc[u] != T.uint8(0))
                            kc[i] = k
                        else:
                            k = order_key(rawb[u], rawc[u] != T.uint8(0))
                        if k != _u(0):
                            T.atomic_add(hist[k >> 21], 1)
            T.sync_threads()

            # ---- level 0: entries (top n_k of [0, n)); level 1: candidate blocks (top k_blocks of [0, nb))
            for lv in T.serial(T.if_then_else(k_blocks > 0, 2, 1)):
                m = T.alloc_var("int32")
                m = T.if_then_else(lv == 0, n, nb)
                if lv == 1:
                    # block keys = max member key overwrite the entry keys in the cache (all reads of those done
                    # before the barrier); the newest visible entry's block gets the maximum key
                    for j in T.serial(NBJ):
                        b = j * NT + tx
                        mx = T.alloc_var("uint32")
                        mx = _u(0)
                        if b * BS < n:
                            if b * BS < C:
                                for e in T.vectorized(BS):
                                    tmp[e] = kc[b * BS + e]
                                for e in T.unroll(BS):
                                    mx = T.max(mx, T.if_then_else(b * BS + e < n, tmp[e], _u(0)))
                            else:
                                for e in T.serial(BS):
                                    mx = T.max(mx, ekey(kc, scores, cand_in, use_cand, row, n, b * BS + e))
                        bm[j] = T.if_then_else(b == fb, _u(MAX_KEY), mx)
                    T.sync_threads()
                    for j in T.serial(NBJ):
                        b = j * NT + tx
                        if b < NBM:
                            kc[b] = bm[j]
                    init_state(ist, ust, hist, tx, want_blocks)
                    for c in T.serial(T.ceildiv(nb, NT)):
                        b = c * NT + tx
                        if b < nb:
                            k = T.alloc_var("uint32")
                            k = bkey(kc, scores, cand_in, use_cand, row, n, fb, nb, b)
                            if k != _u(0):
                                T.atomic_add(hist[k >> 21], 1)
                    T.sync_threads()
                # radix passes: 0 = top 11 key bits (histogram already built), 1-2 = lower key bits,
                # 3-4 = reversed index among entries tied on the full key; each only while still open
                for p in T.serial(5):
                    if ist[1] == 0:
                        shift = T.alloc_var("int32")
                        shift = T.if_then_else(p == 0, 21, T.if_then_else(p == 1, 10, T.if_then_else(p == 3, 11, 0)))
                        if p > 0:
                            hb = T.alloc_var("int32")  # bits at and above hb are fixed by earlier passes
                            hb = T.if_then_else(p == 1, 21, T.if_then_else(p == 2, 10, T.if_then_else(p == 3, 22, 11)))
                            for j in T.unroll(BPT):
                                hist[tx * BPT + j] = 0
                            T.sync_threads()
                            pre = T.alloc_var("uint32")
                            pre = T.if_then_else(p <= 2, ust[0], ust[2])
                            thr = T.alloc_var("uint32")
                            thr = ust[1]
                            hbu = T.cast(hb, "uint32")
                            for c in T.serial(T.ceildiv(m, NT)):
                                i = c * NT + tx
                                if i < m:
                                    k = T.alloc_var("uint32")
                                    if lv == 0:
                                        k = ekey(kc, scores, cand_in, use_cand, row, n, i)
                                    else:
                                        k = bkey(kc, scores, cand_in, use_cand, row, n, fb, nb, i)
                                    val = T.alloc_var("uint32")
                                    val = T.if_then_else(p <= 2, k, _u(TIE_TOP) - T.cast(i, "uint32"))
                                    if (p <= 2 or k == thr) and (val >> hbu) == (pre >> hbu):
                                        T.atomic_add(hist[(val >> T.cast(shift, "uint32")) & _u(BINS - 1)], 1)
                            T.sync_threads()
                        search(hist, wsum, ist, ust, tx, lane, warp, T.cast(shift, "uint32"), p)

                thr = T.alloc_var("uint32")
                thr = ust[1]
                cut = T.alloc_var("int32")
                cut = ist[2]
                if lv == 0:
                    # emit in index order: per chunk of NT*V entries one block scan of the per-thread take counts
                    base = T.alloc_var("int32")
                    base = 0
                    for c in T.serial(T.ceildiv(T.if_then_else(write_mask != 0, n_g, n), CH)):
                        i0 = c * CH + tx * V
                        if i0 + V <= n and i0 + V <= C:
                            for v in T.vectorized(V):
                                kv[v] = kc[i0 + v]
                        else:
                            for v in T.serial(V):
                                kv[v] = ekey(kc, scores, cand_in, use_cand, row, n, i0 + v)
                        cnt = T.alloc_var("int32")
                        cnt = 0
                        for v in T.unroll(V):
                            cnt = cnt + take(kv[v], i0 + v, thr, cut)
                        x = T.alloc_var("int32")
                        x = cnt
                        for o in (1, 2, 4, 8, 16):  # inclusive prefix over the warp
                            y = T.shfl_up(x, o)
                            x = T.if_then_else(lane >= o, x + y, x)
                        if lane == 31:
                            esum[(c % 2) * NW + warp] = x  # double-buffered: one barrier per chunk
                        T.sync_threads()
                        off = T.alloc_var("int32")
                        off = base + x - cnt
                        for w in T.unroll(NW):
                            ws = esum[(c % 2) * NW + w]
                            off = off + T.if_then_else(w < warp, ws, 0)
                            base = base + ws
                        for v in T.unroll(V):
                            t = take(kv[v], i0 + v, thr, cut)
                            if t != 0:
                                if to_rows:  # the entry's pool row in the query's sequence
                                    ids[row, off] = T.cast(rows_tab[seq[row], i0 + v], "int32")
                                else:
                                    ids[row, off] = i0 + v
                                off = off + 1
                            if write_mask != 0:
                                if i0 + v < n_g:
                                    sel_mask[row, i0 + v] = T.cast(t, "uint8")
                    for c in T.serial(T.ceildiv(n_k, NT)):
                        q = c * NT + tx
                        if q >= base and q < n_k:
                            ids[row, q] = -1
                else:
                    for c in T.serial(T.ceildiv(nb, NT)):
                        b = c * NT + tx
                        if b < nb:
                            keep = take(bkey(kc, scores, cand_in, use_cand, row, n, fb, nb, b), b, thr, cut)
                            for e in T.unroll(BS):
                                if b * BS + e < n_g:
                                    cand_out[row, b * BS + e] = T.cast(keep, "uint8")
                T.sync_threads()  # level 1 overwrites the key cache and the state

    # every barrier is placed by hand; the automatic pass cannot see that shared-memory atomics from different
    # threads need none and would add two per streamed chunk
    if to_rows:
        @T.prim_func
        def index_topk_rows(
            scores: T.Tensor((n_q, n_g), "float32"),
            visible: T.Tensor((n_q,), "int32"),
            cand_in: T.Tensor((c_q, c_g), "uint8"),
            ids: T.Tensor((n_q, n_k), "int32"),
            sel_mask: T.Tensor((m_q, m_g), "uint8"),
            cand_out: T.Tensor((o_q, o_g), "uint8"),
            rows_tab: T.Tensor((r_b, n_g), "int64"),
            seq: T.Tensor((n_q,), "int32"),
            use_cand: T.int32,
            write_mask: T.int32,
            k_blocks: T.int32,
        ):
            T.annotate_pass_configs({"tl.disable_thread_storage_sync": True})
            body(scores, visible, cand_in, ids, sel_mask, cand_out, use_cand, write_mask, k_blocks, rows_tab, seq)

        return index_topk_rows

    @T.prim_func
    def index_topk(
        scores: T.Tensor((n_q, n_g), "float32"),
        visible: T.Tensor((n_q,), "int32"),
        cand_in: T.Tensor((c_q, c_g), "uint8"),
        ids: T.Tensor((n_q, n_k), "int32"),
        sel_mask: T.Tensor((m_q, m_g), "uint8"),
        cand_out: T.Tensor((o_q, o_g), "uint8"),
        use_cand: T.int32,
        write_mask: T.int32,
        k_blocks: T.int32,
    ):
        T.annotate_pass_configs({"tl.disable_thread_storage_sync": True})
        body(scores, visible, cand_in, ids, sel_mask, cand_out, use_cand, write_mask, k_blocks, None, None)

    return index_topk
