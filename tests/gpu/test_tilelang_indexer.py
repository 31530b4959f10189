"""TileLang lightning-indexer scores vs the torch op (marker gpu)."""

import pytest
import torch

from deepinfer.kernels.torch import indexer as ref
from deepinfer.kernels.torch import quant

from ._helpers import poison_allocator, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("S,G", [(1, 100), (3, 1000), (6, 4100)])
def test_dense_scores_match_torch(S, G):
    from deepinfer.kernels.tilelang.indexer import indexer_scores

    g = torch.Generator().manual_seed(S + G)
    # the model's inputs are FP4 fake-quantised (exact in bf16)
    q = quant.fake_quant_fp4(torch.randn(S, 32, 128, generator=g), 32).cuda()
    k = quant.fake_quant_fp4(torch.randn(G, 128, generator=g), 32).cuda()
    w = (torch.randn(S, 32, generator=g) * 32**-0.5).cuda()
    poison_allocator()
    one = torch.zeros(S, dtype=torch.long, device="cuda")  # every query scores the one sequence's keys
    out = indexer_scores(q, k[None], one, w, 128**-0.5)
    expect = ref.indexer_scores(q.double(), k[None].double(), one, w.double(), 128**-0.5)
    assert out.shape == (S, G) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_err(out, expect) < 1e-5   # exact products, fp32 sums


@pytest.mark.parametrize("visible", [[5], [130, 700, 1024], [1, 257]])
def test_fp4_cache_scores(visible):
    from deepinfer.kernels.tilelang.indexer import indexer_scores_fp4

    g = torch.Generator().manual_seed(sum(visible))
    B, Gmax = len(visible), 1024
    packed = torch.randint(0, 256, (B, Gmax, 64), dtype=torch.uint8, generator=g)
    scale = torch.randint(120, 128, (B, Gmax, 4), dtype=torch.uint8, generator=g)
    keys = quant.dequant_fp4_rows(packed.view(B * Gmax, 64), scale.view(B * Gmax, 4)).view(B, Gmax, 128)
    q = quant.fake_quant_fp4(torch.randn(B, 32, 128, generator=g), 32).bfloat16()
    w = torch.randn(B, 32, generator=g) * 32**-0.5
    vis = torch.tensor(visible, dtype=torch.int32)
    # the keys sit in a pool in scrambled rows (plus one spare), read through the entry -> row table
    rows = torch.randperm(B * Gmax, generator=g).view(B, Gmax)
    pool = torch.zeros(B * Gmax + 1, 64, dtype=torch.uint8)
    pool_scale = torch.zeros(B * Gmax + 1, 4, dtype=torch.uint8)
    pool[rows], pool_scale[rows] = packed, scale
    poison_allocator()
    out = indexer_scores_fp4(q.cuda(), torch.arange(B, dtype=torch.int32).cuda(), vis.cuda(), pool.cuda(),
                             pool_scale.cuda(), rows.cuda(), w.cuda(), 128**-0.5).cpu()
    for b in range(B):
        n = visible[b]
        expect = ref.indexer_scores(q[b : b + 1].double(), keys[b : b + 1, :n].double(),
                                    torch.zeros(1, dtype=torch.long),
                                    w[b : b + 1].double(), 128**-0.5)
        assert rel_err(out[b : b + 1, :n], expect) < 1e-5
        assert torch.isneginf(out[b, n:]).all()


def test_fp4_scores_are_the_same_bits_for_any_key_tiles_or_queries_per_block():
    """The launcher scores more key tiles per block as batch x context grows (indexer.key_tiles), and two queries a
    block when the step has several per sequence (indexer.queries_per_block): a score must depend on neither, nor
    on where a query's visible count or the entry count ends inside a block's tiles, nor on whether a block's two
    queries share a sequence (one pass) or not (a pass each)."""
    from deepinfer.kernels.tilelang._build import jit
    from deepinfer.kernels.tilelang.indexer import fp4_spec

    g = torch.Generator().manual_seed(7)
    B, G = 3, 2300  # not a multiple of 128 x 16
    # pairs (0,0) (0,1) (1,1) (1,2) (2)
    q_seq = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2], dtype=torch.int32)
    visible = torch.tensor([2300, 1, 129, 2047, 1600, 5, 2300, 640, 641], dtype=torch.int32)
    n_q = len(q_seq)
    rows = torch.randperm(B * G, generator=g).view(B, G)
    pool = torch.randint(0, 256, (B * G + 1, 64), dtype=torch.uint8, generator=g)
    pool_scale = torch.randint(120, 128, (B * G + 1, 4), dtype=torch.uint8, generator=g)
    q = quant.fake_quant_fp4(torch.randn(n_q, 32, 128, generator=g), 32).bfloat16()
    w = torch.randn(n_q, 32, generator=g) * 32**-0.5
    args = [t.cuda() for t in (q, q_seq, visible, pool, pool_scale, rows, w)]
    outs = {}
    for queries in (1, 2):
        for tiles in (1, 4, 16):
            out = torch.full((n_q, G), 7.0, device="cuda")
            jit(*fp4_spec(32, 128, tiles, queries))(*args, out, 128**-0.5)
            outs[queries, tiles] = out.cpu()
    for key, out in outs.items():
        assert torch.equal(out, outs[1, 1]), key
    for i, n in enumerate(visible.tolist()):
        assert torch.isfinite(outs[1, 1][i, :n]).all() and torch.isneginf(outs[1, 1][i, n:]).all()


def test_fp4_prefill_chunk_scores_match_torch():
    """A prefill step's shape through the launcher: several sequences' chunks (odd lengths, a one-token one), each
    query seeing the entries compressed before it, so blocks of two queries (the launcher's pick here) meet
    sequence boundaries."""
    from deepinfer.kernels.tilelang.indexer import indexer_scores_fp4, queries_per_block

    g = torch.Generator().manual_seed(11)
    lengths, G = [5, 1, 300], 400
    B, n_q = len(lengths), sum(lengths)
    assert queries_per_block(n_q, B) == 2
    q_seq = torch.repeat_interleave(torch.arange(B), torch.tensor(lengths)).int()
    visible = torch.cat([torch.arange(G - n + 1, G + 1) for n in lengths]).int()  # causal: one more per query
    packed = torch.randint(0, 256, (B, G, 64), dtype=torch.uint8, generator=g)
    scale = torch.randint(120, 128, (B, G, 4), dtype=torch.uint8, generator=g)
    keys = quant.dequant_fp4_rows(packed.view(B * G, 64), scale.view(B * G, 4)).view(B, G, 128)
    rows = torch.randperm(B * G, generator=g).view(B, G)
    pool = torch.zeros(B * G, 64, dtype=torch.uint8)
    pool_scale = torch.zeros(B * G, 4, dtype=torch.uint8)
    pool[rows], pool_scale[rows] = packed, scale
    q = quant.fake_quant_fp4(torch.randn(n_q, 32, 128, generator=g), 32).bfloat16()
    w = torch.randn(n_q, 32, generator=g) * 32**-0.5
    poison_allocator()
    out = indexer_scores_fp4(q.cuda(), q_seq.cuda(), visible.cuda(), pool.cuda(), pool_scale.cuda(), rows.cuda(),
                             w.cuda(), 128**-0.5).cpu()
    expect = ref.indexer_scores(q.double(), keys.double(), q_seq.long(), w.double(), 128**-0.5)
    for i, n in enumerate(visible.tolist()):
        assert rel_err(out[i, :n], expect[i, :n]) < 1e-5, i
        assert torch.isneginf(out[i, n:]).all(), i
