"""CPU checks of the bulk-copy routed passes (kernels/tilelang/moe_bulk_kernel.py, `moe.BULK_TOKENS`): they lower
for sm_90a with the producer's tensor copies behind mbarriers and mma.sync, ptxas keeps them in registers with no
spill at their blocks an SM, a numpy model of a block's data path (the 128-byte-swizzled box a tensor copy lands,
the block's scales, the tokens' activation slices, the per-lane fragment reads and FP4 decode, a token a B column,
mma.sync's fragment layouts and the result tile) computes exactly W @ X for every token of a chunk, and the
launcher takes them from 2 to BULK_TOKENS tokens a call (one token: moe_warp_kernel's), outside the batch-invariant
mode."""

import importlib.util
import shutil

import numpy as np
import pytest
import torch

from deepinfer.kernels.torch import quant
from test_tilelang_lowering_moe import _bf16, _cute_frag, _e2m1x8, _prmt, _u32, _words_to_vals
from test_tilelang_lowering_moe_warp import zero_experts

tilelang_missing = importlib.util.find_spec("tilelang") is None
PASSES = {"up": ("swiglu", 384, 4608, 5120), "down": ("add", 384, 5120, 2304)}


@pytest.mark.skipif(tilelang_missing or shutil.which("nvcc") is None, reason="needs tilelang and nvcc")
@pytest.mark.parametrize("n_tok,blocks", [(1, 4), (8, 4)])
@pytest.mark.parametrize("name", list(PASSES))
def test_the_bulk_passes_lower_and_fit_their_blocks_an_sm(name, n_tok, blocks, tmp_path):
    """Four blocks an SM (16 math warps: fewer left the decode pacing the pass, s42), one token's slice a stage at
    one token a call (a one-token pass's blocks in one wave), else MAX_TOKENS tokens' in STAGES stages."""
    from lowering_helpers import lower_source, ptxas_report
    from deepinfer.kernels.tilelang import moe_bulk_kernel as mb

    args = PASSES[name]
    st, mt = mb.config(n_tok)
    src = lower_source(mb.build_fp4_bulk_gemm(*args, mb.BLOCK_K, st, mt), "sm_90a")
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in src
    assert "__align__(1024)" in src  # the swizzled boxes land 1 KB-aligned: the ring starts 1 KB past the base
    assert "mma.sync.aligned.m16n8k16" in src and "wgmma.mma_async" not in src
    log, regs = ptxas_report(src, tmp_path)
    assert "0 bytes spill stores" in log and regs * mb.THREADS * blocks <= 65536, (regs, log[-2000:])
    assert blocks * (mb.shared_bytes(args[3], mb.BLOCK_K, st, mt) + 1024) <= 228 * 1024


def test_the_launcher_takes_the_bulk_passes_from_two_tokens_to_bulk_tokens(monkeypatch):
    from deepinfer.kernels import registry
    from deepinfer.kernels.tilelang import moe, moe_bulk_kernel, moe_warp_kernel

    E, I, D = 8, 2304, 5120
    p = zero_experts(E, I, D)
    build = moe_bulk_kernel.build_fp4_bulk_gemm
    assert moe.BULK_TOKENS == 256
    assert moe.routed_specs(p, 1, 6)[0][0] is moe_warp_kernel.build_fp4_warp_gemm  # one token: WARP_STREAM first
    monkeypatch.setattr(moe, "WARP_STREAM", 0)
    for n_tok in (1, 8, 64, 256):
        up, down = moe.routed_specs(p, n_tok, 6)
        st, mt = (4, 1) if n_tok == 1 else (3, 8)  # 4 blocks an SM: one token's slice a stage, else 8 tokens'
        assert up == (build, "swiglu", E, 2 * I, D, 256, st, mt) and down == (build, "add", E, D, I, 256, st, mt)
        assert up in moe.experts_specs(p, None, n_tok, 6)
    assert moe.routed_specs(p, 257, 6)[0][0] is not build
    monkeypatch.setitem(registry._MODE, "batch_invariant", True)
    assert moe.routed_specs(p, 8, 6)[0][0] is not build
    monkeypatch.setitem(registry._MODE, "batch_invariant", False)
    monkeypatch.setattr(moe, "BULK_TOKENS", 0)
    assert moe.routed_specs(p, 8, 6)[0][0] is not build


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
@pytest.mark.parametrize("n_tok", [1, 2, 256, 257])
def test_every_routed_pass_takes_the_grouped_gemms_arguments_and_what_pass_args_adds(n_tok, monkeypatch):
    """moe.ffn (and moe_gpu.py's per-pass breakdown) call a routed pass with the grouped GEMM's ten arguments and
    moe.pass_args's: the bulk passes' one tensor map, nothing for the others (a call short of it fails only on a
    GPU, as moe_gpu.py's breakdown did in the forty-fourth session)."""
    from deepinfer.kernels.tilelang import moe, moe_bulk_kernel

    monkeypatch.setattr(moe_bulk_kernel, "weight_map", lambda w: "tensor map")  # encoded by the driver on a GPU
    p = zero_experts(8, 2304, 5120)
    for spec, w in zip(moe.routed_specs(p, n_tok, 6), (p.w13, p.w2)):
        params = spec[0](*spec[1:]).params
        assert len(params) == 10 + len(moe.pass_args(spec, w)), (spec, len(params))
        assert moe.pass_args(spec, w) == (("tensor map",) if spec[0] is moe_bulk_kernel.build_fp4_bulk_gemm else ())


def _model_bulk_block(w, ws, X, nt, BK=256):
    """A block of moe_bulk_kernel over one chunk of nt tokens: w [64, K/2] packed e2m1 rows, ws [64, K/32] ue8m0,
    X [nt, K] bf16 bits (uint16). Returns the [64, nt] results as the epilogue reads them from `res`."""
    K = 2 * w.shape[1]
    BKP, SCB, SC = BK // 2, BK // 32, K // 32
    WBYTES = 64 * BKP
    scales = ws.reshape(-1)  # one bulk copy of the block's 64 x K/32 scale bytes: row r at r * SC
    res = np.full((64, 8), np.nan)
    for warp in range(4):
        acc = np.zeros((16, 8))
        for kk in range(K // BK):
            st = np.full(WBYTES + 8 * BK * 2, 0xFF, dtype=np.uint8)  # never-written bytes poisoned
            for r in range(64):  # the producer's tensor copy of the box: 128-byte swizzle, chunk c at c ^ (r & 7)
                for c in range(BKP // 16):
                    cs = c ^ (r & 7)
                    st[r * BKP + cs * 16:r * BKP + cs * 16 + 16] = w[r, kk * BKP + c * 16:kk * BKP + c * 16 + 16]
            for j in range(nt):  # and the tokens' activation slices
                st[WBYTES + j * BK * 2:WBYTES + (j + 1) * BK * 2] = X[j, kk * BK:(kk + 1) * BK].astype("<u2").view(
                    np.uint8)
            wrow = warp * 16 * BKP
            sc = warp * 16 * SC + kk * SCB
            for G in range(BK // 64):  # mb_group
                A = np.full((16, 64), np.nan)
                B = np.full((64, 8), np.nan)
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    c = 2 * G + (q >> 1)
                    cs = c ^ g
                    d = []
                    for r, srow in ((g, g), (g + 8, g + 8)):
                        off = wrow + r * BKP + cs * 16 + 8 * (q & 1)
                        s = int(scales[sc + srow * SC + c])
                        w0, scw = _e2m1x8(_u32(st, off), s)
                        w1, _ = _e2m1x8(_u32(st, off + 4), s)
                        d.append((w0 + w1, scw))
                    (d0, sc0), (d1, sc1) = d
                    a = []
                    for t in range(4):  # di3_place_a
                        a += [(d0[2 * t], sc0), (d1[2 * t], sc1), (d0[2 * t + 1], sc0), (d1[2 * t + 1], sc1)]
                    b = [0] * 8
                    if g < nt:
                        base = WBYTES + 2 * (g * BK + 64 * G + 16 * q)
                        inn = [_u32(st, base + 4 * i) for i in range(8)]
                        for j in range(8):
                            e = (j & 3) + 8 * (j >> 2)
                            b[j] = _prmt(inn[e >> 1], inn[(e + 4) >> 1], 0x7632 if e & 1 else 0x5410)
                    for t in range(4):
                        for ri in range(4):
                            lo, hi = _words_to_vals([a[4 * t + ri][0]], a[4 * t + ri][1])
                            for e_, val in ((0, lo), (1, hi)):
                                m, k = _cute_frag(lane, 2 * ri + e_)
                                A[m, 16 * t + k] = val
                        for h in range(2):  # B col layout: b0 = (B[2q][g], B[2q+1][g]), b1 = rows + 8
                            word = b[2 * t + h]
                            B[16 * t + 2 * q + 8 * h, g] = _bf16(word & 0xFFFF)
                            B[16 * t + 2 * q + 8 * h + 1, g] = _bf16(word >> 16)
                assert not np.isnan(A).any() and not np.isnan(B).any()
                acc += A @ B
        for lane in range(32):  # the C fragment into res: rows g, g + 8, columns 2q, 2q + 1
            g, q = lane >> 2, lane & 3
            r = warp * 16 + g
            res[r, 2 * q], res[r, 2 * q + 1] = acc[g, 2 * q], acc[g, 2 * q + 1]
            res[r + 8, 2 * q], res[r + 8, 2 * q + 1] = acc[g + 8, 2 * q], acc[g + 8, 2 * q + 1]
    assert not res[:, nt:].any()  # the columns past the chunk's tokens hold nothing
    return res[:, :nt]


@pytest.mark.parametrize("nt", [1, 3, 8])
def test_a_blocks_data_path_computes_exactly_w_times_x_for_each_token(nt):
    rng = np.random.default_rng(nt)
    K = 512
    w = rng.integers(0, 256, (64, K // 2), dtype=np.uint8)
    ws = rng.integers(115, 129, (64, K // 32), dtype=np.uint8)
    W = quant.dequant_fp4_rows(torch.tensor(w), torch.tensor(ws)).double().numpy()
    xf = torch.randn(nt, K, generator=torch.Generator().manual_seed(nt)).bfloat16()
    X = xf.view(torch.int16).numpy().view(np.uint16)
    got = _model_bulk_block(w, ws, X, nt)
    np.testing.assert_allclose(got, W @ xf.double().numpy().T, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_model_above_matches_the_kernel_source():
    """The index expressions the model reimplements are the ones in the CUDA source."""
    from deepinfer.kernels.tilelang.moe_bulk_kernel import _BULK

    for frag in ("WBYTES = SP_ROWS * BKP", "c = 2 * G + (q >> 1)", "cs = c ^ g", "w + g * BKP + cs * 16 + 8 * (q & 1)",
                 "w + (g + 8) * BKP + cs * 16 + 8 * (q & 1)", "sc[g * SC + c]", "sc[(g + 8) * SC + c]",
                 "scales + warp * 16 * SC + kk * SCB", "stage + warp * 16 * BKP", "xs + g * BK + 64 * G + 16 * q",
                 "(j & 3) + 8 * (j >> 2)", "(e & 1) ? 0x7632 : 0x5410", "if (g < nt)",
                 "mb_tma2d(dst, tm, kk * BKP, e * N + row0, full + st)",
                 "dst + WBYTES + lane * BK * 2", "x + (size_t)xrow * K + kk * BK", "res[r * 8 + 2 * q] = acc[0]",
                 "res[(r + 8) * 8 + 2 * q + 1] = acc[3]", "\"r\"(b[2 * t]),", "di3_place_a(a, d0, d1)"):
        assert frag in _BULK, frag
