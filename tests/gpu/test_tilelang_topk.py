"""TileLang index top-k (radix select) vs the torch op `index_topk` (marker gpu).

Every case checks three things: (1) on tie-free rows the selected set equals the torch op's, and on rows tied at
the threshold it is a valid top-k (same count, every selected score >= every unselected selectable score);
(2) it equals the kernel's documented rule exactly (stable sort by score, lowest index first among equal scores);
(3) the id output is ascending, -1 padded and holds exactly the mask's entries. Outputs come from a poisoned
allocator, so an unwritten element shows up. One compiled kernel serves every case (~10-20 s compile).
"""

import pytest
import torch

from deepinfer.kernels.torch import indexer as ref

from ._helpers import poison_allocator

pytestmark = pytest.mark.gpu

TOPK, KB, BS = 512, 2048, 8


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _visible(S, G, g):
    v = torch.randint(0, G + 3, (S,), device="cuda", generator=g)
    v[: min(S, 4)] = torch.tensor([0, 1, G, G + 5], device="cuda")[: min(S, 4)]  # empty, one entry, full, past G
    return v  # int64, as the model passes it


def _masked(scores, visible, candidates=None):
    G = scores.shape[1]
    s = scores.masked_fill(torch.arange(G, device=scores.device)[None] >= visible[:, None], float("-inf"))
    return s if candidates is None else s.masked_fill(~candidates, float("-inf"))


def _spec(scores, visible, topk, candidates=None, kb=0, bs=BS):
    """The kernel's rule: the first min(topk, #selectable) entries of a stable descending sort (ties: lower index)."""
    S, G = scores.shape
    dev = scores.device
    cand = None
    s = _masked(scores, visible)
    if kb > 0:
        nb = -(-G // bs)
        blocks = torch.nn.functional.pad(s, (0, nb * bs - G), value=float("-inf")).view(S, nb, bs).amax(-1)
        last = torch.div(visible - 1, bs, rounding_mode="floor")
        blocks = blocks.masked_fill(torch.arange(nb, device=dev)[None] == last[:, None], float("inf"))
        o = torch.sort(blocks, dim=-1, descending=True, stable=True).indices[:, :kb]
        keep = torch.zeros(S, nb, dtype=torch.bool, device=dev).scatter_(1, o, blocks.gather(1, o) > float("-inf"))
        cand = keep.repeat_interleave(bs, 1)[:, :G]
    elif candidates is not None:
        s = s.masked_fill(~candidates, float("-inf"))
    o = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :topk]
    sel = torch.zeros(S, G, dtype=torch.bool, device=dev).scatter_(1, o, s.gather(1, o) > float("-inf"))
    return sel, cand


def _check_mask(sel, expect_torch, scores, visible, topk, candidates=None):
    assert sel.dtype == torch.bool and sel.shape == scores.shape
    assert int(sel.view(torch.uint8).max()) <= 1, "mask bytes must be 0/1"
    s = _masked(scores, visible, candidates)
    assert torch.equal(sel.sum(1), expect_torch.sum(1)), "selected count differs from the torch op"
    assert not (sel & torch.isneginf(s)).any(), "selected an excluded entry"
    lo = s.masked_fill(~sel, float("inf")).amin(1)  # smallest selected
    hi = s.masked_fill(sel | torch.isneginf(s), float("-inf")).amax(1)  # largest unselected selectable
    assert (lo >= hi).all(), "not a top-k"
    # rows whose threshold is not tied must match the torch op exactly
    k = min(topk, s.shape[1])
    top = s.topk(min(k + 1, s.shape[1]), dim=-1).values
    tied = (top[:, k - 1] == top[:, k]) if k < s.shape[1] else torch.zeros_like(lo, dtype=torch.bool)
    free = ~tied | torch.isneginf(top[:, k - 1])
    assert torch.equal(sel[free], expect_torch[free]), "tie-free rows differ from the torch op"


def _check_ids(ids, sel, topk):
    assert ids.dtype == torch.int32 and ids.shape == (sel.shape[0], topk)
    n = sel.sum(1)
    pos = torch.arange(topk, device=ids.device)[None]
    assert torch.equal(ids < 0, pos >= n[:, None]) and bool((ids[ids < 0] == -1).all()), "-1 padding"
    big = torch.where(ids < 0, torch.iinfo(torch.int32).max, ids)
    assert bool((big[:, 1:] > big[:, :-1]).logical_or(ids[:, 1:] < 0).all()), "ids not ascending"
    back = torch.zeros_like(sel)
    rows = torch.arange(sel.shape[0], device=ids.device)[:, None].expand_as(ids)
    back[rows[ids >= 0], ids[ids >= 0].long()] = True
    assert torch.equal(back, sel), "ids and mask disagree"


def _run_all(scores, visible, topk, candidates=None, kb=0):
    """The three entry points on poisoned memory, checked against the torch op and the exact rule (the pool rows of
    index_topk_rows against the ids looked up in a random row table)."""
    from deepinfer.kernels.tilelang.topk import index_topk, index_topk_ids, index_topk_rows

    exp_sel, exp_cand = ref.index_topk(scores, visible, topk, candidates, kb, BS if kb else 0)
    spec_sel, spec_cand = _spec(scores, visible, topk, candidates, kb)
    poison_allocator()
    sel, cand = index_topk(scores, visible, topk, candidates, kb, BS if kb else 0)
    poison_allocator()
    out = index_topk_ids(scores, visible, topk, candidates, kb, BS if kb else 0)
    ids, cand2 = out if kb else (out, None)
    S, G = scores.shape
    table = torch.randperm(3 * G * 2, device=scores.device)[: 3 * G].view(3, G)  # 3 sequences' entry rows
    seq = torch.arange(S, device=scores.device, dtype=torch.int32) % 3
    poison_allocator()
    out_rows = index_topk_rows(scores, visible, topk, table, seq, candidates, kb, BS if kb else 0)
    pool_rows, cand3 = out_rows if kb else (out_rows, None)
    torch.cuda.synchronize()
    want_rows = torch.where(ids >= 0, table[seq.long()[:, None], ids.long().clamp_min(0)], -1).int()
    assert torch.equal(pool_rows, want_rows), "index_topk_rows: not the ids' pool rows"
    assert not kb or torch.equal(cand3, cand2)
    _check_mask(sel, exp_sel, scores, visible, topk, None if kb else candidates)
    assert torch.equal(sel, spec_sel), "differs from the lowest-index tie rule"
    _check_ids(ids, sel, topk)
    if kb:
        assert int(cand.view(torch.uint8).max()) <= 1 and torch.equal(cand, cand2)
        assert torch.equal(cand, spec_cand), "candidate mask differs from the lowest-index tie rule"
        assert torch.equal(cand.sum(1), exp_cand.sum(1))
    else:
        assert cand is None
    return sel, cand, exp_cand


@pytest.mark.parametrize("S,G", [(3, 100), (5, 1001), (8, 4096), (64, 16384), (4, 40000), (2, 65536)])
def test_plain_matches_torch(S, G):
    g = _gen(S * 7 + G)
    scores = torch.randn(S, G, device="cuda", generator=g) * 2 - 0.3  # both signs, never exactly 0
    _run_all(scores, _visible(S, G, g), TOPK)


@pytest.mark.parametrize("S,G", [(6, 3001), (3, 16384), (3, 65536)])
def test_ties_valid_topk(S, G):
    g = _gen(S + G)
    scores = torch.randint(-20, 21, (S, G), device="cuda", generator=g).float() + 0.5  # 41 values, none zero
    # row 2 (fully visible): 300 clear winners, then a tie of >1000 entries straddling the threshold
    scores[2] = -30.5
    scores[2, :300] = 100.0 + torch.randn(300, device="cuda", generator=g)
    scores[2, 1000:2500] = 3.5
    vis = _visible(S, G, g)
    _run_all(scores, vis, TOPK)
    _run_all(scores, vis, TOPK, kb=KB)  # tied block maxima: lowest block index first


def test_neg_inf_rows_and_small_topk():
    g = _gen(11)
    S, G = 6, 5000
    scores = torch.randn(S, G, device="cuda", generator=g)
    scores[0] = float("-inf")  # nothing selectable
    scores[1, ::2] = float("-inf")
    scores[2, 300:] = float("-inf")  # fewer selectable than topk
    scores[3, 17] = float("inf")
    vis = torch.full((S,), G, device="cuda")
    _run_all(scores, vis, TOPK)
    _run_all(scores, vis, 7)  # topk not a power of two, much smaller than G


@pytest.mark.parametrize("S,G,kb", [(5, 16384, KB), (5, 40001, KB), (5, 65536, KB), (5, 5000, 64)])
def test_candidate_source(S, G, kb):
    g = _gen(3 * G + kb)
    scores = torch.randn(S, G, device="cuda", generator=g)
    vis = _visible(S, G, g)
    # row 4: the block of the newest visible entry scores lowest of all; it must still be kept
    vis[4] = G - 1234
    b = (G - 1235) // BS * BS
    scores[4, b : b + BS] = -50.0
    _, cand, exp_cand = _run_all(scores, vis, TOPK, kb=kb)
    assert bool(cand[4, G - 1235]), "forced block dropped"
    assert torch.equal(cand, exp_cand), "candidate mask differs from the torch op"  # block maxima are tie-free


def test_restricted_by_candidates():
    """A later index layer: the candidate source's mask restricts the selection (plus a random mask)."""
    from deepinfer.kernels.tilelang.topk import index_topk

    g = _gen(5)
    S, G = 8, 65536
    vis = _visible(S, G, g)
    _, cand = index_topk(torch.randn(S, G, device="cuda", generator=g), vis, TOPK, None, KB, BS)
    _run_all(torch.randn(S, G, device="cuda", generator=g), vis, TOPK, candidates=cand)
    rnd = torch.rand(S, 3000, device="cuda", generator=g) < 0.1
    rnd[1] = False  # nothing allowed
    _run_all(torch.randn(S, 3000, device="cuda", generator=g), _visible(S, 3000, g), TOPK, candidates=rnd)
