"""CPU checks of the grouped expert GEMM (kernels/tilelang/moe_kernel.py): it lowers to CUDA for sm_90a (wgmma
with A from registers) and sm_100a (mma.sync fallback) without a GPU, and a numpy model of its data path (cp.async
placement with the bank swizzle, in-place activation permute, per-lane dequant into wgmma A fragments, the B
descriptor's K-major layout, the D fragment -> epilogue tile map) computes exactly W @ x^T. The fragment layouts
come from cute's ALayout_64x16 / CLayout_64xN formulas, independent of the kernel's own index arithmetic."""

import importlib.util
import shutil

import numpy as np
import pytest
import torch

from deepinfer.kernels.torch import quant

tilelang_missing = importlib.util.find_spec("tilelang") is None

CONFIGS = {  # name: (fmt, epilogue, E, N, K, block_t, block_k, stages, gather[, block_n])
    "up_fp4_bt8": ("fp4", "swiglu", 384, 4608, 5120, 8, 256, 4, True),
    "up_fp4_bt8_k128": ("fp4", "swiglu", 384, 4608, 5120, 8, 128, 8, True),  # 128-K steps, 8 stages
    "up_fp8_bt8_k128_s16": ("fp8", "swiglu", 1, 4608, 5120, 8, 128, 16, True),  # moe.FP8_STAGE_SPLIT = 4
    "up_fp4_bt16_bn128": ("fp4", "swiglu", 384, 4608, 5120, 16, 256, 4, True, 128),
    "down_fp4_bt16_bn128": ("fp4", "add", 384, 5120, 2304, 16, 256, 4, False, 128),
    "down_fp8_bt8_bn128": ("fp8", "add", 1, 5120, 2304, 8, 256, 4, False, 128),
    "down_fp4_bt8": ("fp4", "add", 384, 5120, 2304, 8, 256, 4, False),
    "up_fp4_bt64": ("fp4", "swiglu", 384, 4608, 5120, 64, 256, 4, True),
    "up_fp8_bt8": ("fp8", "swiglu", 1, 4608, 5120, 8, 128, 6, True),
    "down_fp8_bt64": ("fp8", "add", 1, 5120, 2304, 64, 128, 4, False),
    "down_fp4_bt16_k1": ("fp4", "add", 16, 512, 256, 16, 256, 4, False),  # one K step per block
}


def _build(name, **kw):
    from deepinfer.kernels.tilelang.moe_kernel import build_grouped_gemm

    fmt, epi, E, N, K, bt, bk, st, gather, *bn = CONFIGS[name]
    bn = bn[0] if bn else 64
    return build_grouped_gemm(fmt, epi, E, N, K, block_n=bn, block_t=bt, block_k=bk, threads=2 * bn, num_stages=st,
                              gather=gather, **kw)


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_kernel_lowers_to_cuda(name, arch):
    from lowering_helpers import lower_source

    src = lower_source(_build(name), arch)
    assert "__global__" in src and "di3_group<" in src and "di3_permute_x<" in src
    if arch == "sm_90a":
        # the Hopper path: asynchronous wgmma with the A operand from registers (m64nNk16, N = block_t)
        bt = CONFIGS[name][5]
        assert f"wgmma.mma_async.sync.aligned.m64n{bt}k16.f32.bf16.bf16" in src and "wgmma.wait_group" in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src  # the non-Hopper fallback


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_weight_threads_keep_a_stage_in_flight_across_each_barrier():
    """The loads split between the block's halves: the weight threads wait for the next step's weights only
    (cp.async.wait_group 1 at 4 stages, as in the prologue), the activation threads for all theirs before the
    permute's proxy fence (wait_group 0), which only they run."""
    from lowering_helpers import lower_source

    src = lower_source(_build("up_fp4_bt8"), "sm_90a")
    assert src.count("di3_cp_wait<1>") == 2 and src.count("di3_cp_wait<0>") == 1
    loop = src[src.rindex("di3_cp_wait<1>"):]
    assert "di3_permute_x<8>" in loop  # the permute follows the loop's waits, on the activation threads' side


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_moe_kernel_split_k_lowers():
    from lowering_helpers import lower_source

    src = lower_source(_build("down_fp4_bt8", k_splits=3), "sm_90a")
    assert "blockIdx.z" in src and "wgmma" in src
    with pytest.raises(AssertionError):
        _build("up_fp4_bt8", k_splits=2)  # SwiGLU needs the whole K before its nonlinearity


@pytest.mark.slow  # the benchmark's probes: the slow tier
@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_timing_probes_leave_out_the_decode_or_the_mmas_and_the_kernel_as_it_is():
    """moe_gpu.py --probes times the routed passes without their FP4 decode (the packed words feed the MMAs), without
    their MMAs (the fragments feed an add) or without both; the kernel without a probe is the source it was."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.moe_kernel import PROBES

    plain = lower_source(_build("up_fp4_bt8"), "sm_90a")
    decodes = "di3_e2m1x8(p0.x, di3_scale_e2m1(s0), d0);"
    assert decodes in plain and "#if 1" not in plain
    for probe in PROBES[1:]:
        src = lower_source(_build("up_fp4_bt8", probe=probe), "sm_90a")
        assert (decodes in src) == ("nodq" not in probe), probe
        assert ("#if 1\n#pragma unroll" in src) == ("nomma" in probe), probe  # the add that stands for the MMAs
    with pytest.raises(AssertionError, match="probe must be one of"):
        _build("up_fp4_bt8", probe="noload")
    with pytest.raises(AssertionError, match="FP4 decode"):
        _build("up_fp8_bt8", probe="nodq")


@pytest.mark.skipif(tilelang_missing or shutil.which("nvcc") is None, reason="needs tilelang and nvcc")
@pytest.mark.parametrize("name", ["up_fp4_bt8", "up_fp8_bt8", "up_fp4_bt16_bn128", "up_fp4_bt8_k128",
                                  "up_fp8_bt8_k128_s16"])
def test_moe_kernel_sm90_machine_code(name, tmp_path):
    """ptxas on the lowered source: no spills, registers within the occupancy the launch bounds ask for, and no
    'wgmma ... serialized' fallback (which would undo the dequant/MMA overlap)."""
    from lowering_helpers import lower_source, ptxas_report
    from deepinfer.kernels.tilelang.moe_kernel import shared_bytes

    log, regs = ptxas_report(lower_source(_build(name), "sm_90a"), tmp_path)
    assert "0 bytes spill stores" in log and "serialized" not in log, log[-2000:]
    fmt, _, _, _, _, bt, bk, st, _, *bn = CONFIGS[name]
    bn = bn[0] if bn else 64
    blocks = min(4, (227 * 1024) // (shared_bytes(fmt, bt, bk, st, bn) + 1024))
    assert regs * 2 * bn * blocks <= 65536, (regs, blocks)


# ------------------------------------------------------------------------------------------ data-path model
def _bf16(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def _words_to_vals(words, scale_bits):
    """bf16x2 words times a bf16x2 power-of-two scale (exact) -> [lo0, hi0, lo1, hi1, ...]."""
    sc = _bf16(scale_bits & 0xFFFF)
    w = np.asarray(words, dtype=np.uint64)
    out = np.empty(2 * len(words))
    out[0::2] = _bf16(w & 0xFFFF) * sc
    out[1::2] = _bf16(w >> 16) * sc
    return out


def _e2m1x8(w, s):
    """moe_kernel.di3_e2m1x8: 4 bf16x2 words, codes (0,4), (1,5), (2,6), (3,7) of the 32-bit word w."""
    m = 0xFFFFFFFF
    w2 = w >> 8
    words = [((w & 0x000F000F) * 4160) & 0x81C081C0 & m, ((w & 0x00F000F0) * 260) & 0x81C081C0 & m,
             ((w2 & 0x000F000F) * 4160) & 0x81C081C0 & m, ((w2 & 0x00F000F0) * 260) & 0x81C081C0 & m]
    return words, (((s + 126) << 7) * 0x10001) & m


def _prmt(a, b, sel):
    src = list(int(a).to_bytes(4, "little")) + list(int(b).to_bytes(4, "little"))
    return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def _e4m3x8(w0, w1, s):
    """dequant.py di_dq_e4m3x8 on the 8 bytes (w0, w1): same pair order as e2m1."""
    words = []
    for sel in (0x5410, 0x7632):
        w = _prmt(w0, w1, sel)
        words += [((w & 0x007F007F) << 4) | ((w & 0x00800080) << 8), ((w >> 4) & 0x07F007F0) | (w & 0x80008000)]
    sc = (s + 120) << 7
    return words, sc | (sc << 16)


def _u32(buf, off):
    return int.from_bytes(bytes(buf[off:off + 4]), "little")


def _cute_frag(t, v):
    """cute's ALayout_64x16 / CLayout_64xN (same formula): (thread, value) -> (m, k|n) of the 64-row tile;
    Shape ((4,8,4),(2,2,N/8)), Stride ((128,1,16),(64,8,512)) over a column-major 64-row tile."""
    t0, t1, t2 = t % 4, (t // 4) % 8, t // 32
    v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
    off = 128 * t0 + t1 + 16 * t2 + 64 * v0 + 8 * v1 + 512 * v2
    return off % 64, off // 64


def _model_block(fmt, BT, BK, w, ws, x, valid):
    """One block's GEMM through the v3 data path. w: packed [BN, KP] uint8 rows of the tile (BN 64: one
    warpgroup, 128: two); ws: fp4 [BN, K/32], fp8 [BN/32, K/32] uint8; x: [BT, K] bf16 as uint16 bits; valid: [BT]
    bool. Returns D [BN, BT] and, per K step, the A fragments gathered back to [BN, BK] in MMA K order."""
    from deepinfer.kernels.tilelang.moe_kernel import smem_layout

    BN = w.shape[0]
    STAGE, OFF_S, OFF_X, BKP, SCB = smem_layout(fmt, BT, BK, BN)
    K = x.shape[1]
    NG, CPR = BK // 64, BKP // 16
    xb = x.astype("<u2").view(np.uint8).reshape(BT, 2 * K)
    D = np.zeros((BN, BT))
    frags = []
    for kk in range(K // BK):
        st = np.full(STAGE, 0xFF, dtype=np.uint8)  # garbage where nothing is loaded (NaN bf16 pairs)
        for idx in range(BN * CPR):  # cp.async of the weights, 16-byte chunks XOR-swizzled
            r, cc = divmod(idx, CPR)
            swz = 2 * (r % 4) if fmt == "fp4" else 4 * (r % 2)
            cs = (cc // 8) * 8 + ((cc % 8) ^ swz)
            if fmt == "fp4" and CPR == 4:  # 128-K steps: 64-byte rows
                cs = cc ^ (2 * ((r // 2) % 2))
            st[r * BKP + cs * 16:r * BKP + cs * 16 + 16] = w[r, kk * BKP + cc * 16:kk * BKP + cc * 16 + 16]
        for rr in range(BN if fmt == "fp4" else BN // 32):
            st[OFF_S + rr * SCB:OFF_S + rr * SCB + SCB] = ws[rr, kk * SCB:kk * SCB + SCB]
        for idx in range(BT * BK // 8):  # cp.async of the activations, natural 16-byte chunk kc at core row kc
            n, kc = idx % BT, idx // BT
            if valid[n]:
                o = OFF_X + (kc * (BT // 8) + n // 8) * 128 + (n % 8) * 16
                st[o:o + 16] = xb[n, (kk * BK + kc * 8) * 2:(kk * BK + kc * 8) * 2 + 16]
        ROW = (BT // 8) * 128
        for u in range(BT * NG):  # di3_permute_x
            n, G = u % BT, u // BT
            if not valid[n]:
                continue
            base = OFF_X + (8 * G * (BT // 8) + n // 8) * 128 + (n % 8) * 16
            inn = [[_u32(st, base + j * ROW + 4 * i) for i in range(4)] for j in range(8)]
            for s in range(2):
                for c in range(4):
                    o = []
                    for q in range(4):
                        v = inn[2 * q + s]
                        lo, hi = (v[0], v[2]) if c < 2 else (v[1], v[3])
                        o.append(_prmt(lo, hi, 0x7632 if c & 1 else 0x5410))
                    dst = base + (4 * s + c) * ROW
                    st[dst:dst + 16] = np.frombuffer(b"".join(t.to_bytes(4, "little") for t in o), dtype=np.uint8)
        A = np.full((BN, BK), np.nan)
        for tid in range(2 * BN):  # di3_group: per-lane loads and dequant into the A fragment registers
            warp, g, q = tid >> 5, (tid >> 2) & 7, tid & 3
            r0, r1 = 16 * warp + g, 16 * warp + g + 8
            for G in range(NG):
                rows_w = []
                for r in (r0, r1):
                    if fmt == "fp4":
                        c = 2 * G + (q >> 1)
                        cp = (c ^ (2 * ((g >> 1) & 1))) if BKP == 64 else ((c & ~7) | ((c & 7) ^ (2 * (g & 3))))
                        off = r * BKP + cp * 16 + 8 * (q & 1)
                        s = int(st[OFF_S + r * SCB + 2 * G + (q >> 1)])
                        ws0, sc = _e2m1x8(_u32(st, off), s)
                        ws1, _ = _e2m1x8(_u32(st, off + 4), s)
                    else:
                        c = 4 * G + q
                        cp = (c & ~7) | ((c & 7) ^ (4 * (g & 1)))
                        off = r * BKP + cp * 16
                        s = int(st[OFF_S + (warp >> 1) * SCB + 2 * G + (q >> 1)])
                        ws0, sc = _e4m3x8(_u32(st, off), _u32(st, off + 4), s)
                        ws1, _ = _e4m3x8(_u32(st, off + 8), _u32(st, off + 12), s)
                    rows_w.append((ws0 + ws1, sc))
                (d0, sc0), (d1, sc1) = rows_w
                for t in range(4):
                    regs = [(d0[2 * t], sc0), (d1[2 * t], sc1), (d0[2 * t + 1], sc0), (d1[2 * t + 1], sc1)]
                    for ri, (word, sc) in enumerate(regs):
                        lo, hi = _words_to_vals([word], sc)
                        for e, val in ((0, lo), (1, hi)):
                            m, k = _cute_frag(tid % 128, 2 * ri + e)  # warpgroup tid // 128: rows + 64
                            A[64 * (tid // 128) + m, (4 * G + t) * 16 + k] = val
        # B through the descriptor: K-major interleave, start + kb*BT*32, LBO = BT*16 (next 8 K), SBO = 128
        B = np.zeros((BT, BK))
        for kb in range(BK // 16):
            start = OFF_X + kb * BT * 32
            for n in range(BT):
                for k16 in range(16):
                    a = start + (k16 // 8) * (BT * 16) + (n // 8) * 128 + (n % 8) * 16 + (k16 % 8) * 2
                    B[n, kb * 16 + k16] = _bf16(int(st[a]) | (int(st[a + 1]) << 8))
        assert not np.isnan(A).any()
        with np.errstate(invalid="ignore", over="ignore"):
            D[:, valid] += A @ B[valid].T
        frags.append(A)
    return D, frags


@pytest.mark.parametrize("fmt,BT,BK,BN", [("fp4", 8, 256, 64), ("fp4", 16, 512, 64), ("fp4", 8, 128, 64),
                                          ("fp4", 16, 128, 128), ("fp8", 8, 128, 64),
                                          ("fp8", 32, 256, 64), ("fp4", 16, 256, 128), ("fp8", 8, 256, 128)])
def test_moe_kernel_data_path_model(fmt, BT, BK, BN):
    rng = np.random.default_rng(BT * 7 + BK + BN)
    K = 2 * BK
    if fmt == "fp4":
        w = rng.integers(0, 256, (BN, K // 2), dtype=np.uint8)
        ws = rng.integers(115, 129, (BN, K // 32), dtype=np.uint8)
        W = quant.dequant_fp4_rows(torch.tensor(w), torch.tensor(ws)).double().numpy()
    else:
        w = rng.integers(0, 256, (BN, K), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] = 0x11  # e4m3 NaN codes are not weights
        ws = rng.integers(110, 135, (BN // 32, K // 32), dtype=np.uint8)
        W = quant.dequant_fp8_blocks(torch.tensor(w).view(torch.float8_e4m3fn), torch.tensor(ws)).double().numpy()
    xf = torch.randn(BT, K, generator=torch.Generator().manual_seed(BT)).bfloat16()
    x = xf.view(torch.int16).numpy().view(np.uint16)
    valid = np.zeros(BT, dtype=bool)
    valid[rng.choice(BT, size=max(1, BT // 3), replace=False)] = True
    from deepinfer.kernels.tilelang.moe_kernel import k_index

    D, frags = _model_block(fmt, BT, BK, w, ws, x, valid)
    nat = np.array([k_index(kf) for kf in range(BK)])
    assert sorted(nat.tolist()) == list(range(BK))  # the MMA's K order is a permutation of the natural one...
    for kk, A in enumerate(frags):  # ...and the fragments hold exactly the dequantised weights in that order
        assert np.array_equal(A, W[:, kk * BK + nat])
    expect = W @ xf.double().numpy()[valid].T
    np.testing.assert_allclose(D[:, valid], expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("BN", [64, 128])
def test_moe_kernel_epilogue_tile_map(BN):
    """The kernel's acc -> c_s[token][row] store is cute's CLayout_64xN per warpgroup (the second one's rows 64
    further): every (row, token) exactly once."""
    for BT in (8, 16, 32, 64):
        seen = set()
        for tx in range(2 * BN):
            for i in range(BT // 2):
                n = 8 * (i // 4) + 2 * (tx % 4) + i % 2
                m = 16 * (tx // 32) + (tx // 4) % 8 + 8 * ((i // 2) % 2)
                m0, n0 = _cute_frag(tx % 128, i)
                assert (m, n) == (64 * (tx // 128) + m0, n0)
                seen.add((m, n))
        assert len(seen) == BN * BT


def test_moe_kernel_model_matches_source():
    """The constants and index expressions the model above reimplements are the ones in the CUDA source."""
    from deepinfer.kernels.tilelang.moe_kernel import cuda_source

    src = cuda_source(16)
    for frag in ("0x81C081C0u", "4160u", "260u", "((s + 126u) << 7) * 0x10001u", "(2 * (g & 3))", "(4 * (g & 1))",
                 "(c ^ (2 * ((g >> 1) & 1)))", "BKP == 64",
                 "2 * G + (q >> 1)", "4 * G + q", "(warp >> 1) * SCB", "0x7632 : 0x5410", "in[2 * q + s]",
                 "(4 * s + c) * ROW", "(4 * G + t) * BT * 2", "(BT * 16) >> 4", "(128 >> 4) << 32",
                 "a[4 * t + 0] = d0[2 * t]", "a[4 * t + 1] = d1[2 * t]", "a[4 * t + 2] = d0[2 * t + 1]",
                 "a[4 * t + 3] = d1[2 * t + 1]", "m64n16k16"):
        assert frag in src, frag


def test_moe_kernel_e2m1_matches_torch():
    """di3_e2m1x8 (one multiply per pair) reproduces the checkpoint dequantisation exactly, in the pair order."""
    from deepinfer.kernels.tilelang.dequant import fp4_perm

    rng = np.random.default_rng(1)
    perm = [fp4_perm(j) for j in range(8)]
    for _ in range(500):
        b4 = rng.integers(0, 256, 4).astype(np.uint8)
        s = int(rng.integers(90, 129))
        words, sc = _e2m1x8(int.from_bytes(bytes(b4), "little"), s)
        ref = quant.dequant_fp4_rows(torch.tensor(b4[None]), torch.tensor([[s]], dtype=torch.uint8))[0].double()
        assert _words_to_vals(words, sc).tolist() == ref[perm].tolist()


def test_the_shared_expert_table_has_one_slot_per_token_tile():
    """The shared expert's tokens run as side-by-side slots of one token tile each (every token once, in order),
    not as one slot whose blocks walk every tile in turn."""
    from deepinfer.kernels.tilelang.moe import _shared_table

    rows, aw, expert, start, count = _shared_table(70, "cpu", 32)
    assert rows.tolist() == list(range(70)) and aw.tolist() == [1.0] * 70
    assert expert.tolist() == [0, 0, 0] and start.tolist() == [0, 32, 64] and count.tolist() == [32, 32, 6]
    assert _shared_table(5, "cpu", 8)[4].tolist() == [5]  # fewer tokens than a tile: one slot


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_routed_passes_step_and_stages_are_one_ab_knob():
    """moe.FP4_BLOCK_K / FP4_STAGES (256 x 4 by default) set every routed pass's K step and stages, for
    with_attrs.py A/B runs of 128 x 8: the same shared memory at every token tile, and each pass still builds."""
    from unittest import mock

    from deepinfer.kernels.packed_experts import PackedExperts
    from deepinfer.kernels.tilelang import moe
    from deepinfer.kernels.tilelang.moe_kernel import shared_bytes

    t = torch.empty(0)
    routed = PackedExperts("fp4", t.new_empty(384, 2 * 2304, 0), t, t.new_empty(384, 5120, 0), t)
    assert (moe.FP4_BLOCK_K, moe.FP4_STAGES) == (256, 4)
    # (the grouped GEMM's knob: the warp-streamed passes at one token, the bulk ones up to BULK_TOKENS have their own)
    with mock.patch.object(moe, "FP4_BLOCK_K", 128), mock.patch.object(moe, "FP4_STAGES", 8), \
            mock.patch.object(moe, "WARP_STREAM", 0), mock.patch.object(moe, "BULK_TOKENS", 0):
        for n_tok in (1, 8, 64, 256):
            for spec in moe.routed_specs(routed, n_tok, 6):
                fmt, bt, bk, st, bn = spec[1], spec[7], spec[8], spec[10], spec[6]
                assert (fmt, bk, st) == ("fp4", 128, 8)
                assert shared_bytes(fmt, bt, bk, st, bn) == shared_bytes(fmt, bt, 256, 4, bn)
                spec[0](*spec[1:])


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
@pytest.mark.parametrize("split,expect", [(1, (512, 4)), (2, (256, 8)), (4, (128, 16)), (8, (128, 16))])
def test_the_shared_experts_steps_split_into_more_stages(split, expect):
    """moe.FP8_STAGE_SPLIT cuts the shared expert's K step and multiplies its stages (never below 128-K steps):
    the same shared memory up to the stages' 128-byte padding, more steps in flight across each barrier; the pass
    still builds."""
    from unittest import mock

    from deepinfer.kernels.packed_experts import PackedExperts
    from deepinfer.kernels.tilelang import moe
    from deepinfer.kernels.tilelang.moe_kernel import shared_bytes

    t = torch.empty(0)
    shared = PackedExperts("fp8", t.new_empty(1, 2 * 2304, 0), t, t.new_empty(1, 5120, 0), t)
    assert moe.FP8_STAGE_SPLIT == 1
    with mock.patch.object(moe, "FP8_STAGE_SPLIT", split):
        up, down = moe.ffn_specs(shared, moe.shared_block_t(1))
        assert (up[8], up[10]) == expect
        assert 0 <= shared_bytes("fp8", 8, *expect) - shared_bytes("fp8", 8, 512, 4) <= 2048  # stage padding
        for spec in (up, down):
            spec[0](*spec[1:])
