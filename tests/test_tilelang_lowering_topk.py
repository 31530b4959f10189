"""CPU checks of the index top-k kernel (kernels/tilelang/topk_kernel.py), no GPU needed:

* it lowers to CUDA source for sm_90a and sm_100a (as tests/test_tilelang_lowering.py does for the other kernels),
  and, lowered the way jit() compiles it (its own pass configs merged in), keeps its launch shape;
* the wrapper's off-kernel path (CPU tensors) returns the torch op's selection, and as ascending -1 padded ids;
* (slow) the generated CUDA source itself runs correctly: it is compiled for the CPU with tests/cuda_emulation.py
  (one OS thread per CUDA thread, __syncthreads = a barrier over the block, warp shuffles through per-warp slots,
  shared-memory atomics as atomics, cp.async as a copy) and checked against the torch op and the kernel's
  lowest-index tie rule, incl. rows longer than the shared-memory cache and the candidate level.
"""

import importlib.util

import pytest
import torch

from cuda_emulation import compile_kernel, gxx_ok
from deepinfer.kernels.torch import indexer as ref

tilelang_missing = importlib.util.find_spec("tilelang") is None
needs_tilelang = pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")


def _lowered_as_compiled(cache, arch="sm_90a", block_size=8, to_rows=False):
    """CUDA source of the kernel with its function-level pass configs merged in, as tilelang.compile (jit) does."""
    import tilelang
    from tvm import transform

    from deepinfer.kernels.tilelang._build import PASS_CONFIGS, target
    from deepinfer.kernels.tilelang.topk_kernel import build_index_topk

    f = build_index_topk(cache, block_size, 512, to_rows) if to_rows else build_index_topk(cache, block_size)
    cfg = dict(PASS_CONFIGS)
    if f.attrs and "tilelang_pass_configs" in f.attrs:
        cfg.update(dict(f.attrs["tilelang_pass_configs"]))
    tgt = target(arch)
    with tgt, transform.PassContext(opt_level=3, config=cfg):
        return tilelang.lower(f, target=tgt).kernel_source


@needs_tilelang
@pytest.mark.parametrize("arch", ["sm_90a", pytest.param("sm_100a", marks=pytest.mark.slow)])
def test_topk_kernel_lowers_to_cuda(arch):
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.topk import CACHE
    from deepinfer.kernels.tilelang.topk_kernel import build_index_topk

    src = lower_source(build_index_topk(CACHE), arch)
    assert "__global__" in src


@needs_tilelang
def test_topk_kernel_as_compiled():
    from deepinfer.kernels.tilelang.topk import CACHE

    src = _lowered_as_compiled(CACHE)
    assert "__global__" in src
    assert "__launch_bounds__(512, 2)" in src  # two rows per SM
    assert "cp_async" in src  # the row streams into shared memory asynchronously


@needs_tilelang
def test_off_kernel_path_matches_torch_op():
    from deepinfer.kernels.tilelang.topk import index_topk, index_topk_ids

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 300, generator=g)
    vis = torch.tensor([0, 1, 150, 300, 310])
    for kw in ({}, dict(candidate_blocks=10, candidate_block_size=8), dict(candidates=torch.rand(5, 300) < 0.5)):
        sel, cand = index_topk(scores, vis, 64, **kw)
        want_sel, want_cand = ref.index_topk(scores, vis, 64, **kw)
        assert torch.equal(sel, want_sel)
        assert (cand is None and want_cand is None) or torch.equal(cand, want_cand)
        out = index_topk_ids(scores, vis, 400, **kw)
        ids = out[0] if kw.get("candidate_blocks") else out
        assert ids.shape == (5, 400) and ids.dtype == torch.int32
        for s in range(5):
            row = ids[s][ids[s] >= 0]
            assert torch.equal(row, torch.nonzero(ref.index_topk(scores, vis, 400, **kw)[0][s]).flatten().int())
            assert (ids[s][len(row):] == -1).all()


# ------------------------------------------------------------------------------------ CPU emulation of the CUDA
def _emulated_kernel(tmp_path, cache, to_rows=False):
    kernel, _ = compile_kernel(_lowered_as_compiled(cache, to_rows=to_rows), tmp_path)

    def run(scores, visible, topk, candidates=None, kb=0, rows=None, seq=None):
        """Mirrors topk._launch on CPU tensors (rows, seq: the to_rows variant's tables); outputs are poisoned
        first."""
        S, G = scores.shape
        dummy = torch.zeros(1, 1, dtype=torch.uint8)
        use = candidates is not None and kb <= 0
        t = dict(scores=scores.float().contiguous(), visible=visible.int().contiguous(),
                 cand_in=candidates.to(torch.uint8).contiguous() if use else dummy,
                 ids=torch.full((S, topk), 0x7FC00000, dtype=torch.int32),
                 sel_mask=torch.full((S, G), 0xC0, dtype=torch.uint8),
                 cand_out=torch.full((S, G), 0x7F, dtype=torch.uint8) if kb > 0 else dummy)
        dims = dict(n_q=S, n_g=G, n_k=topk, c_q=t["cand_in"].shape[0], c_g=t["cand_in"].shape[1], m_q=S, m_g=G,
                    o_q=t["cand_out"].shape[0], o_g=t["cand_out"].shape[1], use_cand=int(use), write_mask=1,
                    k_blocks=kb)
        if to_rows:
            t.update(rows_tab=rows.long().contiguous(), seq=seq.int().contiguous())
            dims.update(r_b=rows.shape[0])
        kernel(S, **t, **dims)
        return t["ids"], t["sel_mask"], (t["cand_out"] if kb > 0 else None)

    return run


def _rule(scores, visible, topk, candidates=None, kb=0, bs=8):
    """The kernel's documented selection: a stable descending sort (equal scores: lower index first)."""
    S, G = scores.shape
    s = scores.masked_fill(torch.arange(G)[None] >= visible[:, None], float("-inf"))
    cand = None
    if kb > 0:
        nb = -(-G // bs)
        b = torch.nn.functional.pad(s, (0, nb * bs - G), value=float("-inf")).view(S, nb, bs).amax(-1)
        b = b.masked_fill(torch.arange(nb)[None] == torch.div(visible - 1, bs, rounding_mode="floor")[:, None],
                          float("inf"))
        o = torch.sort(b, dim=-1, descending=True, stable=True).indices[:, :kb]
        cand = torch.zeros(S, nb, dtype=torch.bool).scatter_(1, o, b.gather(1, o) > float("-inf"))
        cand = cand.repeat_interleave(bs, 1)[:, :G]
    elif candidates is not None:
        s = s.masked_fill(~candidates, float("-inf"))
    o = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :topk]
    return torch.zeros(S, G, dtype=torch.bool).scatter_(1, o, s.gather(1, o) > float("-inf")), cand


@pytest.mark.slow
@needs_tilelang
@pytest.mark.skipif(not gxx_ok(), reason="needs g++ with C++20 <barrier>")
def test_generated_cuda_runs_correctly_under_cpu_emulation(tmp_path):
    from deepinfer.kernels.tilelang.topk import CACHE

    run = _emulated_kernel(tmp_path, CACHE)
    g = torch.Generator().manual_seed(0)
    ints = lambda S, G: torch.randint(-6, 7, (S, G), generator=g).float() + 0.5  # noqa: E731 - heavy ties
    cases = [  # (scores, visible, topk, candidates, candidate blocks, tie-free)
        (torch.randn(6, 3001, generator=g), torch.tensor([0, 1, 3001, 3009, 700, 2048]), 512, None, 0, True),
        (torch.randn(3, 40, generator=g), torch.tensor([40, 17, 3]), 512, None, 0, True),  # G < topk
        # ~840 distinct values sharing the top key bits: deep radix passes and index tie passes
        (1 + torch.rand(3, 5000, generator=g) * 1e-4, torch.tensor([5000, 4000, 512]), 512, None, 0, False),
        (ints(4, 3000), torch.tensor([3000, 2999, 900, 100]), 512, None, 0, False),
        (torch.randn(4, 4000, generator=g), torch.tensor([4000, 3000, 10, 0]), 512,
         torch.rand(4, 4000, generator=g) < 0.3, 0, True),
        (torch.randn(4, 3001, generator=g), torch.tensor([3001, 2000, 1, 0]), 64, None, 40, True),
        (ints(3, 2000), torch.tensor([2000, 1999, 33]), 64, None, 30, False),
        (torch.randn(2, 20000, generator=g), torch.tensor([20000, 17000]), 512, None, 2048, True),  # > cache
        (torch.randn(1, 40000, generator=g), torch.tensor([39990]), 512, None, 2048, True),  # block keys > cache
    ]
    cases[0][0][4, ::3] = float("-inf")
    for scores, vis, topk, cands, kb, tie_free in cases:
        ids, sel, cand = run(scores, vis, topk, cands, kb)
        assert int(sel.max()) <= 1
        sel = sel.bool()
        want, want_cand = _rule(scores, vis, topk, cands, kb)
        assert torch.equal(sel, want), "selection differs from the lowest-index rule"
        t_sel, t_cand = ref.index_topk(scores, vis, topk, cands, kb, 8 if kb else 0)
        assert torch.equal(sel.sum(1), t_sel.sum(1))
        if tie_free:
            assert torch.equal(sel, t_sel)
            assert kb == 0 or torch.equal(cand.bool(), t_cand)
        if kb:
            assert int(cand.max()) <= 1 and torch.equal(cand.bool(), want_cand)
        for s in range(scores.shape[0]):
            n = int(sel[s].sum())
            assert torch.equal(ids[s, :n], torch.nonzero(sel[s]).flatten().int()) and (ids[s, n:] == -1).all()


@pytest.mark.slow
@needs_tilelang
@pytest.mark.skipif(not gxx_ok(), reason="needs g++ with C++20 <barrier>")
def test_the_rows_variant_writes_each_selected_entrys_pool_row_under_cpu_emulation(tmp_path):
    """build_index_topk(to_rows=True), the kernel of index_topk_rows: the selection the ids kernel makes, written as
    rows[seq[q], id] (-1 padded), equal to the torch op index_topk_rows, with and without the candidate level."""
    from deepinfer.kernels.tilelang.topk import CACHE

    run = _emulated_kernel(tmp_path, CACHE, to_rows=True)
    g = torch.Generator().manual_seed(1)
    B = 3
    for S, G, topk, kb in ((5, 3001, 512, 0), (4, 40, 512, 0), (4, 2500, 64, 30)):
        scores = torch.randn(S, G, generator=g)
        vis = torch.randint(0, G + 1, (S,), generator=g)
        rows = torch.randperm(B * G * 2, generator=g)[: B * G].view(B, G)
        seq = torch.randint(0, B, (S,), generator=g)
        got, _, cand = run(scores, vis, topk, None, kb, rows, seq)
        want = ref.index_topk_rows(scores, vis, topk, rows, seq, None, kb, 8 if kb else 0)
        if kb:
            want, want_cand = want
            assert torch.equal(cand.bool(), want_cand)
        assert torch.equal(got, want), (S, G, topk, kb)
