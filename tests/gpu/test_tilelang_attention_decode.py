"""Decode attention (attention.sink_attention_decode over kernels/tilelang/attention_decode_kernel.py) vs float64 math on the same dequantised keys
(marker gpu). Fresh random inputs in the released cache formats: partly filled window rings (short sequences;
empty slots hold bytes that dequantise to inf/NaN, so an invisible row that reached P V would poison the
output), stale ring slots, sel with -1 padding, 1..6 query tokens per sequence, every split path of the kernel
(one split, uneven splits, a split with no blocks)."""

import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

from ._helpers import fp4_rows16_e4m3, fp8_rows32, poison_allocator, rel_err

pytestmark = pytest.mark.gpu

H, D, W, TOPK = 64, 512, 128, 512
HANG_S = int(os.environ.get("DI_DECODE_HANG_S", "420"))  # first compile + run of the smoke call


@pytest.fixture(scope="module", autouse=True)
def decode_kernel_does_not_hang():
    """The kernel synchronises its warpgroups with mbarriers: a protocol bug (or a register split setmaxnreg cannot
    satisfy) hangs the GPU instead of failing. Run one small call of the default and of each WG1_ROWS candidate in a
    child process first, so a hang costs HANG_S seconds and a clear failure, not the
    whole session. (Compiled kernels land in TileLang's disk cache, so the tests below reuse them.)"""
    code = textwrap.dedent("""
        import torch
        from deepinfer.kernels.tilelang import attention
        from deepinfer.kernels.tilelang.attention import sink_attention_decode
        g = torch.Generator(device="cuda").manual_seed(0)
        B, n_q, P = 2, 3, 700
        for rows, splits in [(r, s) for r in attention.REGS for s in (1, 3)]:  # the default, then the candidates
            attention.WG1_ROWS = rows
            out = sink_attention_decode(
                torch.randn(n_q, 64, 512, device="cuda", generator=g).bfloat16(),
                torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda"),
                torch.tensor([127, 126, 127], dtype=torch.int32, device="cuda"),
                torch.randint(0, 120, (B, 128, 512), dtype=torch.uint8, device="cuda", generator=g),
                torch.full((B, 128, 16), 120, dtype=torch.uint8, device="cuda"),
                torch.arange(128, dtype=torch.int32, device="cuda").repeat(B, 1),
                torch.randint(0, 256, (P, 256), dtype=torch.uint8, device="cuda", generator=g),
                torch.full((P, 32), 0x38, dtype=torch.uint8, device="cuda"),
                torch.randint(0, P, (n_q, 512), dtype=torch.int32, device="cuda", generator=g),
                torch.zeros(64, device="cuda"), 512 ** -0.5, splits=splits)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
        print("decode smoke ok")
    """)
    try:
        # cwd away from the repo root: `python -c` puts the cwd first on sys.path, and the repo's deepinfer/ (no
        # kernels/ inside) would shadow the package
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"decode smoke call did not finish in {HANG_S} s: kernel hang (mbarrier protocol) or slow compile")
    if r.returncode != 0:
        pytest.fail("decode smoke call failed:\n" + (r.stdout + r.stderr)[-3000:])


def _ref64(q, keys, vis, sink, scale):
    """float64 softmax-with-sink over visible keys (K = V); q [S, H, D], keys [S, K, D], vis [S, K] bool.
    Invisible keys are zeroed first: they may hold inf/NaN garbage."""
    keys = torch.where(vis[..., None], keys.double(), 0.0)
    logits = torch.einsum("shd,skd->shk", q.double(), keys) * scale
    logits = logits.masked_fill(~vis[:, None, :], float("-inf"))
    sink = sink.double().view(1, -1, 1)
    m = torch.maximum(logits.amax(-1, keepdim=True), sink)
    e = torch.exp(logits - m)
    den = e.sum(-1, keepdim=True) + torch.exp(sink - m)
    return torch.einsum("shk,skd->shd", e / den, keys)


def _case(B, seed, dev="cuda", ring=W, q_per_seq=None):
    """Random decode batch: per sequence a length (some shorter than the window), 1..6 query tokens at its
    last positions (or `q_per_seq`), its ring of `ring` rows (wider than the window: speculative decoding's
    rollback rows), per-query sel rows into one shared pool."""
    g = torch.Generator().manual_seed(seed)
    R = ring
    if q_per_seq is None:
        q_per_seq = torch.randint(1, 7, (B,), generator=g).tolist()
        if B > 1:
            q_per_seq[0] = 6
    n_q = sum(q_per_seq)
    pool = max(1024, 300 * B)
    win_kv, win_sc, win_deq = fp8_rows32(B * R, D, g)
    win_kv, win_sc, win_deq = win_kv.view(B, R, D), win_sc.view(B, R, D // 32), win_deq.view(B, R, D)
    cmp_kv, cmp_sc, cmp_deq = fp4_rows16_e4m3(pool, D, g)
    # sequence lengths after this step's tokens: short ones leave ring slots empty
    lengths = torch.randint(W + 1, 40000, (B,), generator=g)
    short = torch.rand(B, generator=g) < 0.4
    lengths = torch.where(short, torch.randint(1, W, (B,), generator=g), lengths)
    lengths = torch.maximum(lengths, torch.tensor(q_per_seq))
    win_pos = torch.full((B, R), -1, dtype=torch.int32)
    for b in range(B):
        L = int(lengths[b])
        pos = torch.arange(max(0, L - R), L)
        win_pos[b, pos % R] = pos.int()
        if L > R + 8 and b % 3 == 1:  # a few slots not yet overwritten: stale positions, must be invisible
            stale = torch.randperm(R, generator=g)[:5]
            win_pos[b, stale] -= R
    empty = win_pos < 0
    # empty slots: bytes whose dequantisation is inf/NaN (ue8m0 135 makes the bf16 scale +inf)
    win_kv[empty] = torch.randint(0, 256, (int(empty.sum()), D), dtype=torch.uint8, generator=g)
    win_sc[empty] = 135
    win_deq[empty] = float("nan")
    q_seq = torch.repeat_interleave(torch.arange(B), torch.tensor(q_per_seq)).int()
    q_pos = torch.cat([lengths[b] - 1 - torch.arange(n).flip(0) for b, n in enumerate(q_per_seq)]).int()
    sel = torch.full((n_q, TOPK), -1, dtype=torch.int32)
    for i in range(n_q):
        n_cmp = min(TOPK, int(q_pos[i]) // 2)              # ratio-2 compressed entries visible so far
        n_cmp = min(n_cmp, int(torch.randint(TOPK - 40, TOPK + 1, (1,), generator=g)))
        sel[i, :n_cmp] = torch.randperm(pool, generator=g)[:n_cmp].int()
        holes = torch.rand(TOPK, generator=g) < 0.05       # scattered -1 as well as the tail padding
        sel[i, holes] = -1
    if n_q > 2:
        sel[1] = -1                                          # a query that sees only window keys
    q = (torch.randn(n_q, H, D, generator=g) * 0.5).bfloat16()
    sink = torch.randn(H, generator=g)
    args = [t.to(dev) for t in (q, q_seq, q_pos, win_kv, win_sc, win_pos, cmp_kv, cmp_sc, sel, sink)]
    # reference inputs (float64 math on the GPU: B=64 has ~200 queries x 640 keys)
    keys = torch.cat([win_deq.to(dev)[q_seq.long().to(dev)], cmp_deq.to(dev)[sel.clamp_min(0).long().to(dev)]], 1)
    wp = win_pos.to(dev)[q_seq.long().to(dev)]
    p = q_pos.to(dev)[:, None]
    vis = torch.cat([(wp >= 0) & (wp <= p) & (wp > p - W), sel.to(dev) >= 0], 1)
    return args, (q.to(dev), keys, vis, sink.to(dev))


def _check(out, q, keys, vis, sink, scale):
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    expect = torch.cat([_ref64(q[i:i + 32].float(), keys[i:i + 32], vis[i:i + 32], sink, scale)
                        for i in range(0, q.shape[0], 32)])
    err = rel_err(out, expect)
    # bf16 probabilities times bf16-exact keys, fp32 accumulation: low 1e-3s
    assert err < 5e-3, err
    # every query on its own too: a wrong mask for one query hides in the batch norm
    per_q = [rel_err(out[i], expect[i]) for i in range(q.shape[0])]
    assert max(per_q) < 2e-2, max(per_q)


@pytest.mark.parametrize("q_per_seq", [[4] * 4, [2] * 8], ids=["4x4", "8x2"])
@pytest.mark.parametrize("splits", [None, 8])
def test_verification_rows_over_a_ring_with_rollback_rows(q_per_seq, splits):
    """The shapes of the DSpark verification steps whose logits went NaN on the H200 (docs/dspark.md): 16 query
    tokens (4 sequences x 4, 8 x 2) over 192-row rings (5 drafts' rollback rows), with the default split count and
    with 8 splits of 10 key blocks (what the default gave 16 queries before it left no split empty: three split
    CTAs without a block)."""
    from deepinfer.kernels.tilelang.attention import sink_attention_decode

    args, (q, keys, vis, sink) = _case(len(q_per_seq), seed=77 + len(q_per_seq), ring=192, q_per_seq=q_per_seq)
    scale = D ** -0.5
    poison_allocator()
    out = sink_attention_decode(*args, scale, splits=splits)
    torch.cuda.synchronize()
    _check(out, q, keys, vis, sink, scale)


@pytest.mark.parametrize("B,splits", [(1, None), (1, 3), (5, None), (5, 1), (5, 3), (5, 6), (64, None), (64, 2)])
def test_decode_matches_float64(B, splits):
    from deepinfer.kernels.tilelang.attention import sink_attention_decode

    args, (q, keys, vis, sink) = _case(B, seed=1000 + 17 * B + (splits or 0))
    scale = D ** -0.5
    poison_allocator()
    out = sink_attention_decode(*args, scale, splits=splits)
    torch.cuda.synchronize()
    _check(out, q, keys, vis, sink, scale)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_no_visible_keys_gives_zeros(splits):
    from deepinfer.kernels.tilelang.attention import sink_attention_decode

    g = torch.Generator().manual_seed(11)
    win_kv, win_sc, _ = fp8_rows32(W, D, g)
    cmp_kv, cmp_sc, _ = fp4_rows16_e4m3(64, D, g)
    dev = "cuda"
    out = sink_attention_decode(
        torch.randn(1, H, D, generator=g).bfloat16().to(dev), torch.zeros(1, dtype=torch.int32, device=dev),
        torch.full((1,), 10, dtype=torch.int32, device=dev), win_kv.view(1, W, D).to(dev),
        win_sc.view(1, W, D // 32).to(dev), torch.full((1, W), 500, dtype=torch.int32, device=dev),
        cmp_kv.to(dev), cmp_sc.to(dev), torch.full((1, TOPK), -1, dtype=torch.int32, device=dev),
        torch.randn(H, generator=g).to(dev), D ** -0.5, splits=splits)
    assert torch.equal(out.float().cpu(), torch.zeros(1, H, D))


@pytest.mark.parametrize("ring,splits", [(W, 2), (W, 3), (W, 4), (W, 5), (W, 10), (192, 2), (192, 5), (192, 11)])
def test_clustered_splits_give_the_combine_s_bits(ring, splits):
    """attention.CLUSTER_SPLITS: a query's splits run as one thread block cluster and merge through distributed
    shared memory, with build_sink_combine's arithmetic in its order: the same bits as the split kernel and the
    combine launch, on partly filled and rollback rings, 2-11 splits (splits that start in the window and in the
    pool; 10 and 11 a non-portable cluster), with a poisoned allocator (no partial is read)."""
    from deepinfer.kernels.tilelang import attention

    args, _ = _case(6, seed=4242 + ring + splits, ring=ring)
    scale = D ** -0.5
    with mock.patch.object(attention, "CLUSTER_SPLITS", 0):
        base = attention.sink_attention_decode(*args, scale, splits=splits)
    with mock.patch.object(attention, "CLUSTER_SPLITS", 16):
        poison_allocator()
        cand = attention.sink_attention_decode(*args, scale, splits=splits)
    torch.cuda.synchronize()
    assert torch.equal(base.view(torch.int16), cand.view(torch.int16))


@pytest.mark.parametrize("rows", [16, 12, 20])
@pytest.mark.parametrize("ring,splits", [(W, 1), (W, 2), (W, 3), (W, 10), (192, 1), (192, 5)])
def test_wg1_s_share_of_the_rows_leaves_the_bits(ring, splits, rows):
    """attention.WG1_ROWS (16, the default; 12 and 20 candidates): WG1 dequantises that many rows of every key
    block, the producer the rest; the same bits as the producer converting all 64, with empty ring slots, short
    sequences and a third of the pool's scales 8, across one to ten splits (splits starting in the window and in the
    pool; two and three clustered, ten with one block each) and a rollback ring."""
    from deepinfer.kernels.tilelang import attention

    args, _ = _case(6, seed=991 + ring + splits + rows, ring=ring)
    big = torch.rand(args[7].shape, device=args[7].device) < 0.33
    args[7] = torch.where(big, torch.full_like(args[7], 0x50), args[7])  # e4m3 0x50 = 8
    scale = D ** -0.5
    assert attention.WG1_ROWS == 16  # the default
    with mock.patch.object(attention, "WG1_ROWS", 0):
        base = attention.sink_attention_decode(*args, scale, splits=splits)
    with mock.patch.object(attention, "WG1_ROWS", rows):
        poison_allocator()
        cand = attention.sink_attention_decode(*args, scale, splits=splits)
    torch.cuda.synchronize()
    assert torch.equal(base.view(torch.int16), cand.view(torch.int16))
