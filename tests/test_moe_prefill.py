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


@pytest.mark.parametrize("tokens,skew", [(40, False), (300, False), (300, True)])
def test_grouped_path_matches_the_reference(tokens, skew):
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


def test_the_permuted_k_order_is_a_permutation_within_groups_of_eight():
    perm = moe_prefill.k_perm(64, "cpu")
    assert sorted(perm.tolist()) == list(range(64))
    assert perm[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(perm.view(8, 8) // 8, torch.arange(8)[:, None].expand(8, 8))


def test_the_path_is_for_large_fp4_calls_outside_the_batch_invariant_mode(monkeypatch):
    from deepinfer.kernels import registry

    g = torch.Generator().manual_seed(0)
    fp4, fp8 = _packed(4, 64, 64, g), _packed(4, 64, 64, g, fmt="fp8")
    assert moe_prefill.wanted(moe_prefill.PREFILL_TOKENS, fp4)
    assert not moe_prefill.wanted(moe_prefill.PREFILL_TOKENS - 1, fp4)
    assert not moe_prefill.wanted(moe_prefill.PREFILL_TOKENS, fp8)  # FP8 experts stream at every size
    monkeypatch.setattr(registry, "batch_invariant", lambda: True)
    assert not moe_prefill.wanted(moe_prefill.PREFILL_TOKENS, fp4)
