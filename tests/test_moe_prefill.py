"""The prefill MoE path (kernels/tilelang/moe_prefill.py: tokens grouped by expert into whole tiles, the grouped FP4
GEMM with its permuted K order and SwiGLU epilogue) computes the torch reference's function. On the CPU the GEMM is
its torch contract (expert_gemm_torch); the GPU tests hold the kernel to that contract
(tests/gpu/test_prefill_paths.py)."""

import pytest
import torch

from deepinfer.kernels.packed_experts import PackedExperts
from deepinfer.kernels.tilelang import moe_prefill
from deepinfer.kernels.torch import moe as torch_moe

def _packed(E, D, I, g, fmt="fp4"):
    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def scales(*shape):
        return torch.randint(118, 124, shape, generator=g, dtype=torch.uint8)

    return PackedExperts(fmt, codes(E, 2 * I, D // 2), scales(E, 2 * I, D // 32), codes(E, D, I // 2),
                         scales(E, D, I // 32))


def _shared(D, I, g):
    def codes(*shape):  # e4m3 bytes without NaN codes (0x7f / 0xff)
        return torch.randint(0, 0x7e, shape, generator=g, dtype=torch.uint8) | (
            torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)

    s = lambda *shape: torch.randint(118, 122, shape, generator=g, dtype=torch.uint8)  # noqa: E731
    return PackedExperts("fp8", codes(1, 2 * I, D), s(1, 2 * I // 32, D // 32), codes(1, D, I), s(1, D // 32, I // 32))


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("tokens,skew", [(40, False), (300, False), (300, True)])
def test_grouped_path_matches_the_reference(tokens, skew, block_m, monkeypatch):
    """The GEMM kernel's contract (K in the wgmma fragments' order) at both tile heights (64: paired into 128)."""
    monkeypatch.setattr(moe_prefill, "BLOCK_M", block_m)
    g = torch.Generator().manual_seed(tokens)
    E, D, I, k = 16, 256, 128, 4
    routed, shared = _packed(E, D, I, g), _shared(D, I, g)
    x = torch.randn(tokens, D, generator=g).bfloat16()
    scores = torch.randn(tokens, E, generator=g)
    if skew:  # every token on experts 0..k-1: those hold several tiles each, the other experts none
        scores[:, :k] += 100
    idx = scores.topk(k, -1).indices
    weights = torch.rand(tokens, k, generator=g)
    got = moe_prefill.moe_experts_grouped(x, weights, idx, routed, shared, 7.0)
    ref = torch_moe.moe_experts(x, weights, idx, routed, shared, 7.0)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-3, err  # same rounding points and summation order


def _tiling_of(monkeypatch, x, weights, idx, routed, shared=None):
    """Run the path and return (its output, rows of its grouped layout, the tilings its first GEMM got)."""
    seen = []
    real = moe_prefill.expert_gemm

    def spy(a, tiling, p, which, aw, *rest, **kw):
        seen.append((aw.shape[0], tiling))  # the rows of the layout: one routing weight each
        return real(a, tiling, p, which, aw, *rest, **kw)

    monkeypatch.setattr(moe_prefill, "expert_gemm", spy)
    out = moe_prefill.moe_experts_grouped(x, weights, idx, routed, shared, 7.0)
    return out, seen[0][0], moe_prefill.tilings(seen[0][1])


def _used_tiles(tiling):
    """{(expert, first row, height)} of the entries a kernel block computes (expert -1: an unused entry)."""
    out = set()
    for tile_expert, tile_row, height in tiling:
        rows = tile_row.tolist() if tile_row is not None else [t * height for t in range(tile_expert.numel())]
        out |= {(e, r, height) for e, r in zip(tile_expert.tolist(), rows) if e >= 0}
    return out


def test_an_expert_runs_in_128_row_tiles_and_at_most_one_64_row_tile(monkeypatch):
    """With 64-row tiles an expert's tiles are paired: every row of its padded rows in exactly one used tile, each
    tile one expert's, an expert's odd tile last; the rows beyond the experts' belong to no used tile."""
    monkeypatch.setattr(moe_prefill, "BLOCK_M", 64)
    g = torch.Generator().manual_seed(3)
    E, D, I, k, T_ = 8, 128, 64, 2, 300
    idx = torch.randn(T_, E, generator=g).add(torch.tensor([3.0, 2, 1, 0, 0, 0, 0, -9])).topk(k, -1).indices
    x = torch.randn(T_, D, generator=g).bfloat16()
    _, rows, tiling = _tiling_of(monkeypatch, x, torch.rand(T_, k, generator=g), idx, _packed(E, D, I, g))
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    padded = int(((counts + 63) // 64).sum()) * 64
    assert rows == (T_ * k // 64 + E) * 64 >= padded  # sized by the bound, not by the counts
    owner = torch.full((rows,), -1)
    for e, r, height in _used_tiles(tiling):
        assert height in (64, 128)
        assert (owner[r:r + height] == -1).all()
        owner[r:r + height] = e
    assert (owner[:padded] >= 0).all() and (owner[padded:] == -1).all()
    for e in range(E):
        assert int((owner == e).sum()) == -(-int(counts[e]) // 64) * 64  # the expert's rows, padded to 64
    odd = [e for e in tiling[1][0].tolist() if e >= 0]
    assert odd == [e for e in range(E) if -(-int(counts[e]) // 64) % 2 == 1]


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("tokens,skew", [(40, False), (300, True), (1000, False)])
def test_the_tile_lists_are_sized_before_any_count_is_read(tokens, skew, block_m, monkeypatch):
    """No device sync in the call: the lists' lengths follow from the shapes alone (tokens x top-k / BLOCK_M +
    experts), never from the counts, and their used entries are exactly the tiles of each expert's rows."""
    monkeypatch.setattr(moe_prefill, "BLOCK_M", block_m)
    g = torch.Generator().manual_seed(tokens + block_m)
    E, D, I, k = 16, 256, 128, 4
    x = torch.randn(tokens, D, generator=g).bfloat16()
    scores = torch.randn(tokens, E, generator=g)
    if skew:
        scores[:, :k] += 100
    idx = scores.topk(k, -1).indices.int()  # the router kernel's ids are int32
    _, _, tiling = _tiling_of(monkeypatch, x, torch.rand(tokens, k, generator=g), idx, _packed(E, D, I, g))
    bound = tokens * k // block_m + E
    assert [t.numel() for t, _, _ in tiling] == ([bound // 2 + 1, E] if block_m == 64 else [bound])
    counts = torch.bincount(idx.reshape(-1).long(), minlength=E).tolist()
    expected, row = set(), 0  # each expert's rows from the previous one's end, in tiles of 2 x BLOCK_M then BLOCK_M
    for e, c in enumerate(counts):
        n = -(-c // block_m)
        step = 2 * block_m if block_m == 64 else block_m
        for t in range(n * block_m // step):
            expected.add((e, row + t * step, step))
        if block_m == 64 and n % 2:
            expected.add((e, row + (n - 1) * 64, 64))
        row += n * block_m
    assert _used_tiles(tiling) == expected


def test_the_k_order_is_moe_kernels_fragment_order_in_groups_of_64():
    from deepinfer.kernels.tilelang.moe_kernel import k_index

    perm = moe_prefill.k_perm(128, "cpu")
    assert sorted(perm.tolist()) == list(range(128))
    assert perm.tolist() == [k_index(j) for j in range(128)]
    assert torch.equal(perm.view(2, 64) // 64, torch.arange(2)[:, None].expand(2, 64))
    assert perm[:8].tolist() == [0, 4, 16, 20, 32, 36, 48, 52]  # lane q's pair (2q, 2q+1): codes 16q and 16q + 4


def test_the_path_is_for_large_fp4_calls_outside_the_batch_invariant_mode(monkeypatch):
    from deepinfer.kernels import registry

    g = torch.Generator().manual_seed(0)
    fp4, fp8 = _packed(4, 64, 64, g), _packed(4, 64, 64, g, fmt="fp8")
    assert moe_prefill.wanted(moe_prefill.PREFILL_TOKENS, fp4)
    assert not moe_prefill.wanted(moe_prefill.PREFILL_TOKENS - 1, fp4)
    assert not moe_prefill.wanted(moe_prefill.PREFILL_TOKENS, fp8)  # FP8 experts stream at every size
    monkeypatch.setattr(registry, "batch_invariant", lambda: True)
    assert not moe_prefill.wanted(moe_prefill.PREFILL_TOKENS, fp4)


def test_the_gate_up_gemm_gets_each_layout_row_s_token_row_and_zero_padding(monkeypatch):
    """The first GEMM's input is in tile order: a used layout row holds its token's row (K permuted), each token in
    k rows (once per expert it routes to), a padding row zeros; the down projection reads the first's output."""
    g = torch.Generator().manual_seed(5)
    E, D, I, k, T_ = 8, 128, 64, 2, 100
    x = torch.randn(T_, D, generator=g).bfloat16()
    idx = torch.randn(T_, E, generator=g).topk(k, -1).indices
    calls = []
    real = moe_prefill.expert_gemm

    def spy(a, tiling, p, which, aw, *rest, **kw):
        out = real(a, tiling, p, which, aw, *rest, **kw)
        calls.append((which, a, aw, out))
        return out

    monkeypatch.setattr(moe_prefill, "expert_gemm", spy)
    moe_prefill.moe_experts_grouped(x, torch.rand(T_, k, generator=g), idx, _packed(E, D, I, g), None, 7.0)
    (w13, a, aw, act), (w2, down_in, _, _) = calls
    assert (w13, w2) == ("w13", "w2") and a.shape == (aw.shape[0], D) and down_in is act
    xp = x[:, moe_prefill.k_perm(D, "cpu")]
    used = aw > 0
    assert not a[~used].any()
    # each used row is one token's row, and every token fills k of them
    match = (a[used][:, None, :] == xp[None]).all(-1)
    assert (match.sum(1) >= 1).all()
    assert (match.float().argmax(1).bincount(minlength=T_) == k).all()


@pytest.mark.parametrize("limit", [7.0, 0.0])
def test_the_shared_expert_in_one_gemm_is_the_reference_expert(limit):
    """shared_expert.py: w13 multiplied whole (gate and up rows interleaved), the SwiGLU over the output's halves,
    then w2: torch moe.swiglu_expert's function on separate w1 and w3."""
    from deepinfer.kernels.tilelang.shared_expert import shared_expert

    g = torch.Generator().manual_seed(8)
    D, I = 256, 128
    shared = _shared(D, I, g)
    x = (torch.randn(50, D, generator=g) * 4).bfloat16()
    ref = torch_moe.swiglu_expert(x, *shared.dense(0, torch.bfloat16), limit)
    got = shared_expert(x, shared, limit)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
