"""The bulk-copy routed passes (kernels/tilelang/moe_bulk_kernel.py, `moe.BULK_TOKENS`) on the GPU (marker gpu): the
kernels alone against torch with the same rounding points and bitwise against moe_warp_kernel (a token's sums do
not depend on its column or chunk), through slots of many chunks, a partial chunk and empty slots; and the whole
op through moe.moe_experts_packed at the released width against the torch op, also replayed from a CUDA graph."""

import pytest
import torch

from deepinfer.kernels.torch import moe as ref

from ._helpers import poison_allocator, rel_err
from .test_tilelang_moe_kernel import LIMIT, _experts, _gen, _weights, pass_references

pytestmark = pytest.mark.gpu
KE, KD, KI = 4, 512, 768  # the down pass's K = 768: 3 steps of 256


def _table(tokens, k, E, seed):
    from deepinfer.kernels.tilelang import moe

    g = _gen(seed)
    x = torch.randn(tokens, KD, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).cuda()
    weights = (torch.rand(tokens, k, generator=g) + 0.1).cuda()
    return x, moe.routing_table(idx, weights, E)


@pytest.mark.parametrize("stages,max_tokens", [(3, 8), (4, 4), (6, 8), (4, 1)])
@pytest.mark.parametrize("tokens,k", [(37, 2), (3, 1), (1, 2)])
def test_the_bulk_passes_match_torch_and_are_bitwise_the_warp_streamed_ones(tokens, k, stages, max_tokens):
    """37 tokens x top-2 over 4 experts: ~18 tokens a slot, so 3 chunks of 8 with a partial one (or 18 chunks of
    one, the ring running on across them); 3 tokens x top-1: slots of one token and empty slots (fewer experts
    touched than slots)."""
    from deepinfer.kernels.tilelang import moe_bulk_kernel, moe_warp_kernel
    from deepinfer.kernels.tilelang._build import jit

    routed, dense = _experts(KE, KD, KI, "fp4", torch.Generator(device="cuda").manual_seed(tokens))
    x, table = _table(tokens, k, KE, tokens + 31)
    n_pos = tokens * k
    poison_allocator()
    h = torch.empty(n_pos, KI, dtype=torch.bfloat16, device="cuda")
    cfg = (moe_bulk_kernel.BLOCK_K, stages, max_tokens)
    jit(moe_bulk_kernel.build_fp4_bulk_gemm, "swiglu", KE, 2 * KI, KD, *cfg)(
        x, *table, routed.w13, routed.s13, h, LIMIT, moe_bulk_kernel.weight_map(routed.w13))
    h_warp = torch.empty_like(h)
    jit(moe_warp_kernel.build_fp4_warp_gemm, "swiglu", KE, 2 * KI, KD)(
        x, *table, routed.w13, routed.s13, h_warp, LIMIT)
    torch.cuda.synchronize()
    h_ref, y_ref = pass_references(x, table, dense, h)
    assert torch.isfinite(h).all() and rel_err(h, h_ref) < 1e-2, rel_err(h, h_ref)
    assert torch.equal(h, h_warp), (h - h_warp).abs().max()
    y = torch.zeros(tokens, KD, dtype=torch.float32, device="cuda")
    jit(moe_bulk_kernel.build_fp4_bulk_gemm, "add", KE, KD, KI, *cfg)(
        h, *table, routed.w2, routed.s2, y, LIMIT, moe_bulk_kernel.weight_map(routed.w2))
    y_warp = torch.zeros_like(y)
    jit(moe_warp_kernel.build_fp4_warp_gemm, "add", KE, KD, KI, moe_warp_kernel.BLOCK_K, moe_warp_kernel.STAGES,
        False)(h, *table, routed.w2, routed.s2, y_warp, LIMIT)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all() and rel_err(y, y_ref) < 5e-3, rel_err(y, y_ref)
    if k == 1:  # one add into zeros an element: no atomic order, so the bits are the warp kernel's
        assert torch.equal(y, y_warp), (y - y_warp).abs().max()
    else:
        assert rel_err(y, y_warp) < 1e-6


@pytest.mark.parametrize("tokens", [1, 5, 64, 200])
def test_the_op_with_the_bulk_passes_matches_torch_at_the_released_width(tokens, monkeypatch):
    """moe.BULK_TOKENS on: the routed passes of moe_experts_packed take the bulk kernel (8 experts of 5120 x 2304,
    the shared expert beside them), against the torch op; then replayed from a CUDA graph (no host reads)."""
    from deepinfer.kernels.tilelang import moe, moe_bulk_kernel

    E, D, I = 8, 5120, 2304
    routed, dense, shared, shared_dense = _weights(E, D, I, "fp4", True)
    monkeypatch.setattr(moe, "BULK_TOKENS", 256)
    monkeypatch.setattr(moe, "WARP_STREAM", 0)  # one token too
    k = 6
    assert moe.routed_specs(routed, tokens, k)[0][0] is moe_bulk_kernel.build_fp4_bulk_gemm
    g = _gen(tokens + 500)
    x = torch.randn(tokens, D, generator=g).bfloat16().cuda()
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).cuda()
    weights = (torch.rand(tokens, k, generator=g) + 0.1).cuda()
    poison_allocator()
    out = moe.moe_experts_packed(x, weights, idx, routed, shared, LIMIT)
    expect = ref.moe_experts(x, weights, idx, dense, shared_dense, LIMIT)
    assert torch.isfinite(out).all() and rel_err(out, expect) < 1e-2, rel_err(out, expect)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe.moe_experts_packed(x, weights, idx, routed, shared, LIMIT)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(replayed).all() and rel_err(replayed, out) < 1e-3
