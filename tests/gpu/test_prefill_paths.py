"""The prefill-size paths on the GPU (marker gpu), each against the torch reference on fresh random inputs:
the FP4 grouped expert GEMM (against its torch contract) and the combine kernel, the grouped MoE path
(moe_prefill.py) and the dequantise + cuBLAS FP8 projection from their row thresholds, and the prefill attention
over window strips through the model."""

import pytest
import torch

from deepinfer.kernels.packed_experts import pack_experts
from deepinfer.kernels.torch import moe as torch_moe

from ._helpers import FLASH_WIDTH, fp4_rows, fp8_blocks, poison_allocator, rel_err

pytestmark = [pytest.mark.gpu, FLASH_WIDTH]


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("epilogue", ["swiglu", "plain"])
def test_fp4_expert_gemm_kernel_keeps_its_torch_contract(epilogue, block_m, monkeypatch):
    """Tiles of 3, 1 and 2 tiles per expert (experts 0, 2, 5 of 6; the rest without rows), zero padding rows,
    released widths; the kernel at both tile heights against expert_gemm_torch (the kernel's permuted K order,
    bf16 rounding points)."""
    from deepinfer.kernels.tilelang import moe_prefill
    from deepinfer.kernels.tilelang.moe_prefill import expert_gemm, expert_gemm_torch

    monkeypatch.setattr(moe_prefill, "BLOCK_M", block_m)
    BLOCK_M = block_m

    g = torch.Generator(device="cuda").manual_seed(11)
    E, D, I = 6, 5120, 2304
    routed, _ = _experts(E, D, I, g)
    tile_expert = torch.tensor([0, 0, 0, 2, 5, 5], dtype=torch.int32, device="cuda")
    rows = tile_expert.numel() * BLOCK_M
    k = D if epilogue == "swiglu" else I
    a = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    a[BLOCK_M * 3 - 5:BLOCK_M * 3] = 0  # the padding rows of expert 0's last tile
    aw = torch.rand(rows, device="cuda", generator=g)
    which = "w13" if epilogue == "swiglu" else "w2"
    poison_allocator()
    got = expert_gemm(a, tile_expert, routed, which, aw, epilogue, 7.0)
    w, s = (routed.w13, routed.s13) if which == "w13" else (routed.w2, routed.s2)
    ref = expert_gemm_torch(a, tile_expert, w, s, "fp4", aw, epilogue, 7.0)
    assert got.shape == ref.shape == (rows, ref.shape[1]) and torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-2
    assert torch.equal(got[BLOCK_M * 3 - 5:BLOCK_M * 3], torch.zeros_like(got[:5]))


@pytest.mark.parametrize("epilogue", ["swiglu", "plain"])
def test_the_kernel_takes_tiles_of_two_heights_at_their_own_rows(epilogue):
    """moe_prefill's paired tiling: 128-row tiles of experts 0, 2 and 5 and 64-row tiles of 0 and 5, each at its
    own rows, two launches into one output; against the torch contract."""
    from deepinfer.kernels.tilelang.moe_prefill import expert_gemm, expert_gemm_torch

    g = torch.Generator(device="cuda").manual_seed(12)
    E, D, I = 6, 5120, 2304
    routed, _ = _experts(E, D, I, g)
    t = lambda *v: torch.tensor(v, dtype=torch.int32, device="cuda")  # noqa: E731
    tiling = [(t(0, 2, 5), t(0, 192, 320), 128), (t(0, 5), t(128, 448), 64)]
    k = D if epilogue == "swiglu" else I
    a = torch.randn(512, k, device="cuda", generator=g).bfloat16()
    aw = torch.rand(512, device="cuda", generator=g)
    which = "w13" if epilogue == "swiglu" else "w2"
    poison_allocator()
    got = expert_gemm(a, tiling, routed, which, aw, epilogue, 7.0)
    w, s = (routed.w13, routed.s13) if which == "w13" else (routed.w2, routed.s2)
    ref = expert_gemm_torch(a, tiling, w, s, "fp4", aw, epilogue, 7.0)
    assert torch.isfinite(got).all() and rel_err(got, ref) < 1e-2


def test_moe_combine_kernel_is_the_torch_sum_bitwise():
    from deepinfer.kernels.tilelang.moe_prefill import combine

    g = torch.Generator(device="cuda").manual_seed(5)
    out = torch.randn(3000, 5120, device="cuda", generator=g).bfloat16()
    tok_rows = torch.randint(0, 3000, (777, 6), device="cuda", generator=g)
    shared_y = torch.randn(777, 5120, device="cuda", generator=g).bfloat16()
    poison_allocator()
    got = combine(out, tok_rows, shared_y)
    ref = combine(out.cpu(), tok_rows.cpu(), shared_y.cpu())
    assert torch.equal(got.cpu(), ref)


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
    assert moe_prefill.wanted(tokens, routed)
    poison_allocator()
    got = moe.moe_experts(x, w, idx, routed, shared, 7.0)  # the registered op takes the grouped path here
    ref = torch_moe.moe_experts(x, w, idx, routed, shared, 7.0)
    assert torch.isfinite(got).all() and rel_err(got, ref) < 1e-2


def test_the_dense_kernel_dequantises_every_finite_e4m3_code_at_every_realistic_scale_exactly():
    """fp8_dense_kernel.py against Fp8BlockWeight.dense: every finite e4m3 code (subnormals and both zeros
    included) under block scales from 2^-30 to 2^7, bit for bit, at a V4.1-Flash projection shape."""
    from deepinfer.kernels.fp8_weight import Fp8BlockWeight
    from deepinfer.kernels.tilelang import linear as launcher

    g = torch.Generator(device="cuda").manual_seed(5)
    n, k = 1280, 5120
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    codes = finite[torch.randint(0, finite.numel(), (n, k), device="cuda", generator=g)]
    scale = torch.randint(97, 135, (n // 32, k // 32), dtype=torch.uint8, device="cuda", generator=g)
    w = Fp8BlockWeight(codes, scale)
    got = launcher.dense_bf16(w)
    assert torch.equal(got.view(torch.int16), w.dense(torch.bfloat16).view(torch.int16))


def test_the_shared_expert_dequantised_for_cublas_has_the_packed_values():
    """linear.expert_dense (the shared expert from moe.SHARED_DENSE_TOKENS tokens and in the grouped prefill MoE):
    the one-pass kernel per stored matrix, bit for bit PackedExperts.dense's (w1, w2, w3) at Flash width."""
    from deepinfer.kernels.tilelang.linear import expert_dense

    g = torch.Generator(device="cuda").manual_seed(9)
    _, shared = _experts(1, 5120, 2304, g)
    w13, w2 = expert_dense(shared, 0, torch.bfloat16)
    w1, w3 = shared.split_w13(w13)
    for got, ref in zip((w1, w2, w3), shared.dense(0, torch.bfloat16)):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("limit", [7.0, 0.0])
def test_the_swiglu_over_interleaved_halves_is_the_torch_passes_bitwise(limit):
    """swiglu_kernel.py against shared_expert.swiglu_halves_torch (the reference's casts, clamp, silu and product)
    at the shared expert's width over a prefill chunk, values past the clamp included; then the shared expert whole
    against torch moe.swiglu_expert (one GEMM over w13 against two: cuBLAS's sums may differ in order)."""
    from deepinfer.kernels.tilelang.shared_expert import shared_expert, swiglu_halves, swiglu_halves_torch
    from deepinfer.kernels.torch import moe as torch_moe

    g = torch.Generator(device="cuda").manual_seed(13)
    h = (torch.randn(2051, 2 * 2304, device="cuda", generator=g) * 6).bfloat16()
    poison_allocator()
    got = swiglu_halves(h, limit)
    assert torch.equal(got.view(torch.int16), swiglu_halves_torch(h, limit).view(torch.int16))
    _, shared = _experts(1, 5120, 2304, g)
    x = torch.randn(300, 5120, device="cuda", generator=g).bfloat16()
    ref = torch_moe.swiglu_expert(x, *shared.dense(0, torch.bfloat16), limit)
    assert rel_err(shared_expert(x, shared, limit), ref) < 1e-2


def test_prefill_rows_take_dequantise_and_cublas_and_match_the_reference():
    from deepinfer.kernels import registry
    from deepinfer.kernels.fp8_weight import Fp8BlockWeight
    from deepinfer.kernels.tilelang import linear as launcher

    g = torch.Generator(device="cuda").manual_seed(3)
    codes, scale, deq = fp8_blocks(1024, 4096, g)
    w = Fp8BlockWeight(codes, scale)
    assert torch.equal(launcher.dense_bf16(w), w.dense(torch.bfloat16))
    x = torch.randn(launcher.DENSE_ROWS + 3, 4096, device="cuda", generator=g).bfloat16()
    before = registry.fallback_counts().get("linear", {})
    out = launcher.linear(x, w)
    assert registry.fallback_counts().get("linear", {}) == before
    assert torch.equal(out, torch.nn.functional.linear(x, w.dense(torch.bfloat16)))
    assert rel_err(out, x.double() @ deq.double().T) < 1e-2
