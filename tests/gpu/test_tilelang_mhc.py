"""TileLang mHC kernels vs float64 references of the torch ops, on fresh random inputs (marker gpu).

The torch ops compute in fp32 internally (`.float()`), so the float64 references are written out with the same
formulas (the mixes': _helpers.mhc_mixes64). Bands (METHOD): fp32 outputs (pre/post/comb) within 1e-5 relative of float64; bf16 outputs within 1e-2 of
float64 and, against the torch op run in fp32 on the same GPU and rounded, equal but for rare last-bit flips."""

import pytest
import torch

from deepinfer.kernels.torch import mhc as ref

from ._helpers import mhc_mixes64 as mixes64, poison_allocator, rel_err

pytestmark = pytest.mark.gpu

HC, D, ITERS, HC_EPS, NORM_EPS = 4, 5120, 20, 1e-6, 1e-6
N = (2 + HC) * HC
TOKENS = [1, 7, 64, 300, 4096]


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _streams(tokens, g):
    # N(0, 1) per element with a per-token scale over two decades: a token's RMS must stay its own
    s = 10 ** (torch.rand(tokens, 1, 1, generator=g, device="cuda") * 2 - 1)
    return (torch.randn(tokens, HC, D, generator=g, device="cuda") * s).bfloat16()


def _mix_params(g):
    fn = torch.randn(N, HC * D, generator=g, device="cuda") * 0.02
    scale = torch.rand(3, generator=g, device="cuda") + 0.5
    base = torch.randn(N, generator=g, device="cuda") * 0.5
    return fn, scale, base


def _check_mixes(got, streams, fn, scale, base):
    pre, post, comb = got
    t = streams.shape[0]
    assert pre.shape == (t, HC) and post.shape == (t, HC) and comb.shape == (t, HC, HC)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for out in got:
        assert torch.isfinite(out).all()
    expect = mixes64(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    for name, out, e in zip(("pre", "post", "comb"), got, expect):
        assert rel_err(out, e) < 1e-5, (name, rel_err(out, e))
        # per token too: a wrong token hides in a big batch's norm
        per_tok = ((out.double() - e).reshape(t, -1).norm(dim=1) / e.reshape(t, -1).norm(dim=1)).max().item()
        assert per_tok < 1e-4, (name, per_tok)


@pytest.mark.parametrize("tokens", TOKENS)
def test_mixes_match_float64(tokens):
    from deepinfer.kernels.tilelang.mhc import mhc_mixes

    g = _gen(tokens)
    streams = _streams(tokens, g)
    fn, scale, base = _mix_params(g)
    poison_allocator()
    got = mhc_mixes(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    torch.cuda.synchronize()
    _check_mixes(got, streams, fn, scale, base)


@pytest.mark.parametrize("splits", [1, 16])
def test_mixes_other_split_counts(splits):
    # the prefill variants (1 split: a 320-step pipeline; 16) at a size the automatic choice sends elsewhere
    from deepinfer.kernels.tilelang.mhc import mixes_with_splits

    g = _gen(100 + splits)
    streams = _streams(300, g)
    fn, scale, base = _mix_params(g)
    poison_allocator()
    got = mixes_with_splits(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS, splits)
    torch.cuda.synchronize()
    _check_mixes(got, streams, fn, scale, base)


@pytest.mark.parametrize("tokens", TOKENS)
def test_the_one_launch_mixes_are_bitwise_the_two_launch_mixes(tokens):
    """The premix's last block of each token tile finalizes it (one launch): the same partial sums in the same
    order as the separate finalize kernel, so the same bits, call after call (the tile counters back at zero)."""
    from deepinfer.kernels.tilelang.counters import tile_counters
    from deepinfer.kernels.tilelang.mhc import BLOCK_K, _splits, mixes_with_splits

    g = _gen(3000 + tokens)
    streams = _streams(tokens, g)
    fn, scale, base = _mix_params(g)
    splits = _splits(tokens, HC * D // BLOCK_K)
    args = (streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS, splits)
    one, again = mixes_with_splits(*args), mixes_with_splits(*args)
    two = mixes_with_splits(*args, fused=False)
    torch.cuda.synchronize()
    for a, b, c in zip(one, again, two):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert not tile_counters(streams.device).any()


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_the_gemv_mixes_match_float64_and_replay_from_a_graph(tokens, monkeypatch):
    """The GEMV mixes (mhc.GEMV_TOKENS, mhc_gemv_kernel.py; 4 by default) at up to 8 tokens a call: the fp32 band of
    the float64 reference, per token too; the same bits call after call (a fixed summation order) and replayed from a
    CUDA graph (where fn's loads start before the programmatic wait); the tile counters back at zero."""
    from deepinfer.kernels.tilelang import mhc as wrap
    from deepinfer.kernels.tilelang.counters import tile_counters

    monkeypatch.setattr(wrap, "GEMV_TOKENS", 8)
    g = _gen(5000 + tokens)
    streams = _streams(tokens, g)
    fn, scale, base = _mix_params(g)
    assert wrap.gemv_fits(tokens, HC, D)
    poison_allocator()
    got = wrap.mhc_mixes(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    again = wrap.mhc_mixes(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    torch.cuda.synchronize()
    _check_mixes(got, streams, fn, scale, base)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    from deepinfer.kernels.tilelang._build import jit, pdl_enabled
    from deepinfer.kernels.tilelang.mhc_gemv_kernel import build_mhc_mixes_gemv

    if pdl_enabled():  # the graph's build (fn's loads before the wait) loaded off the capture
        jit(build_mhc_mixes_gemv, HC, D, wrap.GEMV_SPLITS, 8, ITERS, wrap.TILE_COUNTERS,
            HC * D // (wrap.GEMV_SPLITS * 128), True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = wrap.mhc_mixes(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, replayed))
    assert not tile_counters(streams.device).any()


def _bf16_checks(out, expect64, torch_op):
    assert out.dtype == torch.bfloat16 and out.shape == torch_op.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, expect64) < 1e-2, rel_err(out, expect64)
    # same fp32 math as the torch op up to FMA contraction / summation order -> rare last-bit flips after rounding
    flips = (out != torch_op).float().mean().item()
    assert flips < 1e-3 and rel_err(out, torch_op) < 1e-3, (flips, rel_err(out, torch_op))


@pytest.mark.parametrize("tokens", TOKENS)
def test_collapse_matches(tokens):
    from deepinfer.kernels.tilelang.mhc import mhc_collapse

    g = _gen(1000 + tokens)
    streams = _streams(tokens, g)
    pre = torch.rand(tokens, HC, generator=g, device="cuda") + 1e-6  # sigmoid + eps range
    poison_allocator()
    out = mhc_collapse(streams, pre)
    torch.cuda.synchronize()
    expect = (pre.double().unsqueeze(-1) * streams.double()).sum(-2)
    _bf16_checks(out, expect, ref.mhc_collapse(streams, pre))


@pytest.mark.parametrize("tokens", TOKENS)
def test_expand_matches(tokens):
    from deepinfer.kernels.tilelang.mhc import mhc_expand

    g = _gen(2000 + tokens)
    x = torch.randn(tokens, D, generator=g, device="cuda").bfloat16()
    residual = _streams(tokens, g)
    post = 2 * torch.rand(tokens, HC, generator=g, device="cuda")
    comb = torch.rand(tokens, HC, HC, generator=g, device="cuda")
    comb = comb / comb.sum(-2, keepdim=True)  # column-stochastic, like the Sinkhorn output
    poison_allocator()
    out = mhc_expand(x, residual, post, comb)
    torch.cuda.synchronize()
    expect = (torch.einsum("tjk,tjd->tkd", comb.double(), residual.double())
              + post.double().unsqueeze(-1) * x.double().unsqueeze(-2))
    _bf16_checks(out, expect, ref.mhc_expand(x, residual, post, comb))


def test_leading_dims():
    # [B, S, hc, D] inputs: same results as the flattened token batch
    from deepinfer.kernels.tilelang.mhc import mhc_collapse, mhc_expand, mhc_mixes

    g = _gen(7)
    streams = _streams(6, g)
    fn, scale, base = _mix_params(g)
    flat = mhc_mixes(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    nested = mhc_mixes(streams.view(2, 3, HC, D), fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    for a, b in zip(flat, nested):
        assert b.shape[:2] == (2, 3) and torch.equal(a, b.reshape(a.shape))
    x = torch.randn(6, D, generator=g, device="cuda").bfloat16()
    assert torch.equal(mhc_collapse(streams.view(2, 3, HC, D), flat[0].view(2, 3, HC)).reshape(6, D),
                       mhc_collapse(streams, flat[0]))
    e = mhc_expand(x.view(2, 3, D), streams.view(2, 3, HC, D), flat[1].view(2, 3, HC), flat[2].view(2, 3, HC, HC))
    assert e.shape == (2, 3, HC, D) and torch.equal(e.reshape(6, HC, D), mhc_expand(x, streams, flat[1], flat[2]))


def test_fp32_streams_fall_back_to_torch(monkeypatch):
    from deepinfer.kernels.tilelang import mhc as tl_mhc

    def no_kernel(*a, **k):
        raise AssertionError("kernel path taken for an input it does not cover")

    monkeypatch.setattr(tl_mhc, "jit", no_kernel)
    g = _gen(11)
    streams = _streams(5, g).float()
    fn, scale, base = _mix_params(g)
    got = tl_mhc.mhc_mixes(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    want = ref.mhc_mixes(streams, fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    pre, post, comb = want
    assert torch.equal(tl_mhc.mhc_collapse(streams, pre), ref.mhc_collapse(streams, pre))
    x = torch.randn(5, D, generator=g, device="cuda")
    assert torch.equal(tl_mhc.mhc_expand(x, streams, post, comb), ref.mhc_expand(x, streams, post, comb))


# rows 1-3: 512 lanes a row in ATen's reduction at width 5120, 4-7: 128, 8-15: 64, from 16: 32
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 12, 16, 40, 300])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_the_one_launch_collapse_norm_is_bitwise_the_collapse_then_the_norm(tokens, weight_dtype, either_mode):
    from deepinfer.kernels.tilelang import mhc, rowwise

    g = _gen(3000 + tokens)
    streams = _streams(tokens, g)
    pre = torch.rand(tokens, HC, generator=g, device="cuda") + 1e-6
    weight = (1 + 0.3 * torch.randn(D, generator=g, device="cuda")).to(weight_dtype)
    ref_out = rowwise.rms_norm(mhc.mhc_collapse(streams, pre), weight, NORM_EPS)
    poison_allocator()
    out = mhc.mhc_collapse_norm(streams, pre, weight, NORM_EPS)
    torch.cuda.synchronize()
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    view = torch.int16 if out.element_size() == 2 else torch.int32
    assert torch.equal(out.view(view), ref_out.view(view)), (tokens, weight_dtype, int((out != ref_out).sum()))
