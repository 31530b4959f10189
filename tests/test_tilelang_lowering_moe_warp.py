"""CPU checks of the one-token routed-expert passes (kernels/tilelang/moe_warp_kernel.py, `moe.WARP_STREAM`): it
lowers for sm_90a and sm_100a, ptxas keeps it in registers at four blocks an SM, a numpy model of one warp's data
path (the swizzled cp.async ring, the per-lane fragment reads and FP4 decode, the token's columns as the B
fragment of column 0, mma.sync m16n8k16's fragment layouts) computes exactly W @ x, and the launcher takes it only
when asked, at one token, outside the batch-invariant mode."""

import importlib.util
import shutil

import numpy as np
import pytest
import torch

from deepinfer.kernels.torch import quant
from test_tilelang_lowering_moe import _bf16, _cute_frag, _e2m1x8, _prmt, _u32, _words_to_vals

tilelang_missing = importlib.util.find_spec("tilelang") is None
PASSES = {"up": ("swiglu", 384, 4608, 5120, 256, 5, True), "down": ("add", 384, 5120, 2304, 256, 5, False)}


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", list(PASSES))
def test_the_warp_streamed_passes_lower_without_a_barrier_in_the_k_loop(name, arch):
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.moe_warp_kernel import build_fp4_warp_gemm

    src = lower_source(build_fp4_warp_gemm(*PASSES[name]), arch)
    assert "dim_rows<256, 5, " in src and "mma.sync.aligned.m16n8k16" in src and "wgmma.mma_async" not in src
    body = src[src.index("void dim_rows"):src.index("extern \"C\"")]
    assert "__syncthreads" not in body and body.count("__syncwarp()") == 2  # the K loop meets only its own warp


@pytest.mark.skipif(tilelang_missing or shutil.which("nvcc") is None, reason="needs tilelang and nvcc")
@pytest.mark.parametrize("name", list(PASSES))
def test_the_warp_streamed_passes_fit_four_blocks_an_sm(name, tmp_path):
    from lowering_helpers import lower_source, ptxas_report
    from deepinfer.kernels.tilelang.moe_warp_kernel import THREADS, build_fp4_warp_gemm, shared_bytes

    args = PASSES[name]
    log, regs = ptxas_report(lower_source(build_fp4_warp_gemm(*args), "sm_90a"), tmp_path)
    assert "0 bytes spill stores" in log and regs * THREADS * 4 <= 65536, (regs, log[-2000:])
    assert 4 * (shared_bytes(args[3], args[4], args[5]) + 1024) <= 228 * 1024  # 432 / 480 blocks: one wave


def _model_warp_step(w, ws, x, kk, BK=256):
    """One warp's K step kk through moe_warp_kernel's data path. w [16, K/2] packed e2m1 rows, ws [16, K/32] ue8m0,
    x [K] bf16 bits (uint16). Returns the step's 16 row sums (column 0 of the MMA tile)."""
    BKP, SCB = BK // 2, BK // 32
    CPR = BKP // 16
    st = np.full(16 * BKP + 16 * SCB, 0xFF, dtype=np.uint8)
    for lane in range(32):  # dim_issue
        for i in range(16 * CPR // 32):
            idx = i * 32 + lane
            r, c = divmod(idx, CPR)
            cs = (c & ~7) | ((c & 7) ^ (2 * (r & 3)))
            st[r * BKP + cs * 16:r * BKP + cs * 16 + 16] = w[r, kk * BKP + c * 16:kk * BKP + c * 16 + 16]
        if lane < 16:
            st[16 * BKP + lane * SCB:16 * BKP + lane * SCB + SCB] = ws[lane, kk * SCB:kk * SCB + SCB]
    xb = x.astype("<u2").view(np.uint8)
    acc = np.zeros((16, 8))
    for G in range(BK // 64):  # dim_group
        A = np.full((16, 64), np.nan)
        B = np.full((64, 8), np.nan)
        for lane in range(32):
            g, q = lane >> 2, lane & 3
            c = 2 * G + (q >> 1)
            cp = (c & ~7) | ((c & 7) ^ (2 * (g & 3)))
            d = []
            for r in (g, g + 8):
                off = r * BKP + cp * 16 + 8 * (q & 1)
                s = int(st[16 * BKP + r * SCB + 2 * G + (q >> 1)])
                w0, sc = _e2m1x8(_u32(st, off), s)
                w1, _ = _e2m1x8(_u32(st, off + 4), s)
                d.append((w0 + w1, sc))
            (d0, sc0), (d1, sc1) = d
            a = []
            for t in range(4):  # di3_place_a
                a += [(d0[2 * t], sc0), (d1[2 * t], sc1), (d0[2 * t + 1], sc0), (d1[2 * t + 1], sc1)]
            base = 2 * (kk * BK + 64 * G + 16 * q)  # the token's 16 columns, natural order, as bytes
            inn = [_u32(xb, base + 4 * i) for i in range(8)]
            b = []
            for j in range(8):
                e = (j & 3) + 8 * (j >> 2)
                b.append(_prmt(inn[e >> 1], inn[(e + 4) >> 1], 0x7632 if e & 1 else 0x5410) if g == 0 else 0)
            for t in range(4):
                for ri in range(4):
                    lo, hi = _words_to_vals([a[4 * t + ri][0]], a[4 * t + ri][1])
                    for e_, val in ((0, lo), (1, hi)):
                        m, k = _cute_frag(lane, 2 * ri + e_)  # mma.sync's A layout = cute's per warp
                        A[m, 16 * t + k] = val
                for h in range(2):  # B col layout: b0 = (B[2q][g], B[2q+1][g]), b1 = rows + 8
                    word = b[2 * t + h]
                    B[16 * t + 2 * q + 8 * h, g] = _bf16(word & 0xFFFF)
                    B[16 * t + 2 * q + 8 * h + 1, g] = _bf16(word >> 16)
        assert not np.isnan(A).any() and not np.isnan(B).any()
        acc += A @ B
    assert not acc[:, 1:].any()  # columns 1..7 hold no token
    return acc[:, 0]


@pytest.mark.parametrize("seed", [0, 1])
def test_one_warps_data_path_computes_exactly_w_times_x(seed):
    rng = np.random.default_rng(seed)
    K = 512
    w = rng.integers(0, 256, (16, K // 2), dtype=np.uint8)
    ws = rng.integers(115, 129, (16, K // 32), dtype=np.uint8)
    W = quant.dequant_fp4_rows(torch.tensor(w), torch.tensor(ws)).double().numpy()
    xf = torch.randn(K, generator=torch.Generator().manual_seed(seed)).bfloat16()
    x = xf.view(torch.int16).numpy().view(np.uint16)
    got = sum(_model_warp_step(w, ws, x, kk) for kk in range(K // 256))
    np.testing.assert_allclose(got, W @ xf.double().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_model_above_matches_the_kernel_source():
    """The index expressions the model reimplements are the ones in the CUDA source."""
    from deepinfer.kernels.tilelang.moe_warp_kernel import _WARP

    for frag in ("(c & ~7) | ((c & 7) ^ (2 * (r & 3)))", "(c & ~7) | ((c & 7) ^ (2 * (g & 3)))", "c = 2 * G + (q >> 1)",
                 "8 * (q & 1)", "16 * BKP + g * SCB + 2 * G + (q >> 1)", "(j & 3) + 8 * (j >> 2)",
                 "(e & 1) ? 0x7632 : 0x5410", "g == 0 ?", "k0 + 64 * G + 16 * q", "lane < 16",
                 "\"r\"(b[2 * t]),", "\"r\"(b[2 * t + 1])", "di3_place_a(a, d0, d1)"):
        assert frag in _WARP, frag


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def zero_experts(E: int, I: int, D: int):
    """FP4 PackedExperts of E experts (hidden D, inter I), all zero bytes: the launcher's specs need shapes only."""
    from deepinfer.kernels.packed_experts import PackedExperts

    u8 = torch.uint8
    return PackedExperts("fp4", torch.zeros(E, 2 * I, D // 2, dtype=u8), torch.zeros(E, 2 * I, D // 32, dtype=u8),
                         torch.zeros(E, D, I // 2, dtype=u8), torch.zeros(E, D, I // 32, dtype=u8))


def test_the_launcher_takes_the_warp_streamed_passes_at_one_token_outside_the_invariant_mode(monkeypatch):
    from deepinfer.kernels import registry
    from deepinfer.kernels.tilelang import moe, moe_warp_kernel

    E, I, D = 8, 2304, 5120
    p = zero_experts(E, I, D)
    build = moe_warp_kernel.build_fp4_warp_gemm
    assert moe.WARP_STREAM == 1
    up, down = moe.routed_specs(p, 1, 6)
    assert up == (build, "swiglu", E, 2 * I, D) and down == (build, "add", E, D, I, 256, 5, False)
    assert up in moe.experts_specs(p, None, 1, 6) and down in moe.experts_specs(p, None, 1, 6)
    assert moe.routed_specs(p, 2, 6)[0][0] is not build  # from two tokens a call the bulk passes
    monkeypatch.setattr(moe, "WARP_STREAM", 0)
    assert moe.routed_specs(p, 1, 6)[0][0] is not build
    monkeypatch.setattr(moe, "WARP_STREAM", 1)
    monkeypatch.setitem(registry._MODE, "batch_invariant", True)
    assert moe.routed_specs(p, 1, 6)[0][0] is not build
