"""The prefill-size paths on the GPU (marker gpu), each against the torch reference on fresh random inputs:
the FP4 expert dequant kernel (bitwise), the grouped MoE path (moe_prefill.py) and the dequantise + cuBLAS FP8
projection from their row thresholds, and the prefill attention over window strips through the model."""

import pytest
import torch

from deepinfer.kernels.packed_experts import _dequant, pack_experts
from deepinfer.kernels.torch import moe as torch_moe

from ._helpers import FLASH_WIDTH, fp4_rows, fp8_blocks, poison_allocator, rel_err

pytestmark = [pytest.mark.gpu, FLASH_WIDTH]


@pytest.mark.parametrize("rows,cols", [(7, 5120), (4608, 5120), (33, 2304), (5, 256)])
def test_fp4_dequant_kernel_is_the_torch_dequantisation_bitwise(rows, cols):
    from deepinfer.kernels.tilelang.moe_prefill import dense_rows

    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    packed, scale, _ = fp4_rows(rows, cols, g, scale_lo=100, scale_hi=140)
    poison_allocator()
    out = dense_rows("fp4", packed[None], scale[None], cols)[0]
    assert torch.equal(out, _dequant("fp4", packed, scale).bfloat16())


def _experts(E, D, I, g):
    w1, s1, w3, s3, w2, s2 = [], [], [], [], [], []
    for _ in range(E):
        a, sa, _ = fp4_rows(I, D, g)
        b, sb, _ = fp4_rows(I, D, g)
        c, sc, _ = fp4_rows(D, I, g)
        w1.append(a); s1.append(sa); w3.append(b); s3.append(sb); w2.append(c); s2.append(sc)
    routed = pack_experts("fp4", w1, s1, w3, s3, w2, s2)
    a, sa, _ = fp8_blocks(I, D, g)
    b, sb, _ = fp8_blocks(I, D, g)
    c, sc, _ = fp8_blocks(D, I, g)
    return routed, pack_experts("fp8", [a], [sa], [b], [sb], [c], [sc])


@pytest.mark.parametrize("tokens,skew", [(1500, False), (2047, True)])
def test_grouped_moe_matches_the_reference_at_flash_width(tokens, skew, monkeypatch):
    from deepinfer.kernels.tilelang import moe, moe_prefill

    monkeypatch.setattr(moe_prefill, "PREFILL_TOKENS", 1024)  # the path from 1024 tokens, 40 experts: a quick test
    g = torch.Generator(device="cuda").manual_seed(tokens)
    E, D, I, k = 40, 5120, 2304, 6
    routed, shared = _experts(E, D, I, g)
    x = torch.randn(tokens, D, device="cuda", generator=g).bfloat16()
    scores = torch.randn(tokens, E, device="cuda", generator=g)
    if skew:
        scores[:, :k] += 50
    idx = scores.topk(k, -1).indices
    w = torch.rand(tokens, k, device="cuda", generator=g)
    assert moe_prefill.wanted(tokens)
    poison_allocator()
    got = moe.moe_experts(x, w, idx, routed, shared, 7.0)  # the registered op takes the grouped path here
    ref = torch_moe.moe_experts(x, w, idx, routed, shared, 7.0)
    assert torch.isfinite(got).all() and rel_err(got, ref) < 1e-2


def test_prefill_rows_take_dequantise_and_cublas_and_match_the_reference():
    from deepinfer.kernels import registry
    from deepinfer.kernels.fp8_weight import Fp8BlockWeight
    from deepinfer.kernels.tilelang import linear as launcher

    g = torch.Generator(device="cuda").manual_seed(3)
    codes, scale, deq = fp8_blocks(1024, 4096, g)
    w = Fp8BlockWeight(codes, scale)
    assert torch.equal(launcher.dense_bf16(w), w.dense(torch.bfloat16))
    x = torch.randn(launcher.PREFILL_ROWS + 3, 4096, device="cuda", generator=g).bfloat16()
    before = registry.fallback_counts().get("linear", {})
    out = launcher.linear(x, w)
    assert registry.fallback_counts().get("linear", {}) == before
    assert torch.equal(out, torch.nn.functional.linear(x, w.dense(torch.bfloat16)))
    assert rel_err(out, x.double() @ deq.double().T) < 1e-2
