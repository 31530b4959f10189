"""CPU checks of the TileLang backend: every kernel lowers to CUDA source for sm_90a and sm_100a without a GPU,
the in-register FP4/FP8 dequant bit tricks (dequant.py) reproduce the torch dequantisation exactly, and the
manifest registers the backend for CUDA only."""

import importlib.util

import numpy as np
import pytest
import torch

from deepinfer.kernels.torch import quant

tilelang_missing = importlib.util.find_spec("tilelang") is None


def _kernels():
    from deepinfer.kernels.tilelang import attention_combine_kernel as comb
    from deepinfer.kernels.tilelang import attention_kernel as att
    from deepinfer.kernels.tilelang import indexer_kernel as idx
    from deepinfer.kernels.tilelang import moe_prep_kernel, moe_router_kernel

    return {
        "moe_prep": lambda: moe_prep_kernel.build_moe_prep(384, 6),
        "moe_prep_zero": lambda: moe_prep_kernel.build_moe_prep(384, 6, 5120),
        "router_logits": lambda: moe_router_kernel.build_router_logits(384, 5120),
        "router_logits_one_split": lambda: moe_router_kernel.build_router_logits(384, 5120, 64, 256, 1),
        "router_topk": lambda: moe_router_kernel.build_router_topk(384, 20, 6, "sqrtsoftplus", True),
        "attn_dense": lambda: att.build_sink_attention_dense(splits=2),
        "attn_dense_single": lambda: att.build_sink_attention_dense(splits=1),
        "attn_combine": lambda: comb.build_sink_combine(splits=4),
        "indexer_dense": lambda: idx.build_indexer_scores("dense"),
        "indexer_fp4": lambda: idx.build_indexer_scores("fp4"),
        "indexer_fp4_tiles": lambda: idx.build_indexer_scores("fp4", tiles=16),
        "indexer_fp4_pairs": lambda: idx.build_indexer_scores("fp4", tiles=16, queries=2),
    }


# The grouped expert GEMM (moe_kernel) and the decode attention kernel (attention_decode_kernel) have their own
# lowering tests: test_tilelang_lowering_moe.py, test_tilelang_lowering_attention_decode.py.
@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", ["moe_prep", "moe_prep_zero", "router_logits", "router_logits_one_split",
                                  "router_topk", "attn_dense", "attn_dense_single", "attn_combine", "indexer_dense",
                                  "indexer_fp4", "indexer_fp4_tiles",
                                  pytest.param("indexer_fp4_pairs", marks=pytest.mark.slow)])  # 39-50 s to lower
def test_kernel_lowers_to_cuda(name, arch):
    from lowering_helpers import lower_source

    src = lower_source(_kernels()[name](), arch)
    assert "__global__" in src
    if name.startswith("moe_prep"):  # the table's block; with zero_cols, blocks past it storing 16-byte zeros
        assert ("*(float4*)(zero + " in src) == name.endswith("zero")
    if arch == "sm_90a" and name.startswith(("attn_dense", "indexer")):
        assert "wgmma" in src  # the matrix kernels must take the Hopper tensor-core path


# ---- bit-level model of dequant.py's CUDA functions (uint32 ops, bf16 = top half of an fp32) ----
def _bf16(bits16) -> float:
    return float(np.array([int(bits16) << 16], dtype=np.uint32).view(np.float32)[0])


def _pairs(words, scale_bits):
    sc = _bf16(scale_bits & 0xFFFF)
    out = []
    for w in words:
        w &= 0xFFFFFFFF
        out += [_bf16(w & 0xFFFF) * sc, _bf16(w >> 16) * sc]
    return out


def _dq_e2m1x8(b4, s):
    w = int.from_bytes(bytes(b4), "little")
    return _pairs([((w << 6) & 0x01C001C0) | ((w << 12) & 0x80008000),
                   ((w << 2) & 0x01C001C0) | ((w << 8) & 0x80008000),
                   ((w >> 2) & 0x01C001C0) | ((w << 4) & 0x80008000),
                   ((w >> 6) & 0x01C001C0) | (w & 0x80008000)], (s + 126) << 7)


def _prmt(a, b, sel):
    src = list(a.to_bytes(4, "little")) + list(b.to_bytes(4, "little"))
    return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def _dq_e4m3x8(b8, s):
    w0, w1 = int.from_bytes(bytes(b8[:4]), "little"), int.from_bytes(bytes(b8[4:]), "little")
    words = []
    for sel in (0x5410, 0x7632):
        w = _prmt(w0, w1, sel)
        words += [((w & 0x007F007F) << 4) | ((w & 0x00800080) << 8), ((w >> 4) & 0x07F007F0) | (w & 0x80008000)]
    return _pairs(words, (s + 120) << 7)


def test_dequant_bit_tricks_match_torch():
    from deepinfer.kernels.tilelang.dequant import CUDA_SOURCE, fp4_perm

    # the model above must describe the CUDA source: check its constants are the ones in it
    for const in ("0x01C001C0u", "0x80008000u", "0x5410", "0x7632", "0x007F007Fu", "0x07F007F0u", "126u", "120u"):
        assert const in CUDA_SOURCE
    perm = [fp4_perm(j) for j in range(8)]
    assert sorted(perm) == list(range(8))
    rng = np.random.default_rng(0)
    for _ in range(300):
        b4 = rng.integers(0, 256, 4).astype(np.uint8)
        s = int(rng.integers(90, 129))
        ref = quant.dequant_fp4_rows(torch.tensor(b4[None]), torch.tensor([[s]], dtype=torch.uint8))[0].double()
        assert _dq_e2m1x8(b4, s) == ref[perm].tolist()
        b8 = rng.integers(0, 256, 8).astype(np.uint8)
        b8[(b8 & 0x7F) == 0x7F] = 0x11  # e4m3 NaN codes are not weights
        s = int(rng.integers(90, 135))
        ref = torch.tensor(b8).view(torch.float8_e4m3fn).double() * 2.0 ** (s - 127)
        assert _dq_e4m3x8(b8, s) == ref[perm].tolist()


def test_manifest_registers_cuda_only():
    from deepinfer.kernels import registry

    ours = [e for e in registry.registered() if e.backend == "tilelang-sm90"]
    # every op kind but the ViT's attention (torch SDPA's flash kernel, reported as a fallback: docs/vision.md);
    # `linear` takes FP8 weights, dense ones go to cuBLAS
    assert {e.kind for e in ours} == set(registry.OP_KINDS) - {"vision_attention"}
    assert all(e.devices == ("cuda",) for e in ours)
    assert "tilelang-sm90" not in registry.backends_for("moe_experts", "cpu")


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_indexer_key_tiles_fill_the_gpu_and_grow_with_the_context():
    from deepinfer.kernels.tilelang.indexer import FILL_BLOCKS, key_tiles

    assert key_tiles(1, 8192) == 1                  # one query: every tile its own block
    assert key_tiles(256, 8192) == 16 and key_tiles(64, 8192) == 4
    for n_q, n_g in ((1, 100), (8, 8192), (64, 1024), (256, 1024), (256, 32768), (1024, 128)):
        t = key_tiles(n_q, n_g)
        blocks = n_q * -(-(-(-n_g // 128)) // t)
        assert t == 1 or blocks >= FILL_BLOCKS
    assert key_tiles(8192, 8192, 2) == 16 and key_tiles(64, 8192, 2) == 1  # two queries a block: half the blocks


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_indexer_pairs_queries_only_when_sequences_have_several():
    from deepinfer.kernels.tilelang.indexer import SHARED_QUERIES, queries_per_block

    assert queries_per_block(64, 64) == 1 and queries_per_block(1, 1) == 1  # decode: a query per sequence
    assert queries_per_block(8192, 1) == SHARED_QUERIES                       # a prefill chunk
    assert queries_per_block(256, 64) == SHARED_QUERIES                       # DSpark's verification rows


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_router_logits_take_one_split_from_a_1k_chunk_only_outside_the_invariant_mode(monkeypatch):
    from deepinfer.kernels import registry
    from deepinfer.kernels.tilelang import moe

    assert moe.ROUTER_ONE_SPLIT_TOKENS == 1024  # the default: one split from a 1K prefill chunk
    assert moe._router_splits(5120, 1023) == 20 and moe._router_splits(5120, 8192) == 1
    monkeypatch.setattr(moe, "ROUTER_ONE_SPLIT_TOKENS", 0)
    assert moe._router_splits(5120, 8192) == 20  # the knob off: the decode split at any size
    monkeypatch.setattr(moe, "ROUTER_ONE_SPLIT_TOKENS", 1024)
    monkeypatch.setattr(registry, "batch_invariant", lambda: True)
    assert moe._router_splits(5120, 8192) == 20  # a token's sum order must not follow the batch


def _indexer_fp4_schedule(q, q_seq, visible, pool_keys, rows, w, scale, queries, tiles, bg=128):
    """The fp4 indexer kernel's block loop in torch (indexer_kernel.indexer_scores_fp4, one thread's view of the
    key registers): passes per sequence, each pass's entry limit, the first tile's rows and keys fetched before the
    loop, the next tile's keys and the one after's rows fetched behind each dequantisation. Unwritten scores stay
    NaN, so a tile the schedule skipped shows."""
    n_q, n_g = q.shape[0], rows.shape[1]
    out = torch.full((n_q, n_g), float("nan"), dtype=torch.float64)
    fetch_rows = lambda t, b: rows[b, (t * bg + torch.arange(bg)).clamp(max=n_g - 1)]  # noqa: E731
    for bq in range(-(-n_q // queries)):
        s0 = bq * queries
        last = min(s0 + queries, n_q) - 1
        n_pass = 1 if q_seq[last] == q_seq[s0] else last - s0 + 1
        reach = max(visible[s0], visible[last])
        for bx in range(-(-n_g // (bg * tiles))):
            for p in range(queries):
                if p >= n_pass:
                    continue
                b = int(q_seq[s0 + p])
                lim = reach if n_pass == 1 else visible[s0 + p]
                mine = [s for s in range(s0, last + 1) if n_pass == 1 or s == s0 + p]
                if bx * tiles * bg < lim:
                    prow = fetch_rows(bx * tiles, b)
                    packed = pool_keys[prow]
                    prow = fetch_rows(bx * tiles + 1, b)
                for t in range(tiles):
                    g0 = (bx * tiles + t) * bg
                    cols = torch.arange(g0, max(g0, min(g0 + bg, n_g)))  # entries past n_g: not written
                    if g0 < lim:
                        k_s = packed  # the dequantised tile
                        if t + 1 < tiles and g0 + bg < lim:
                            packed = pool_keys[prow]
                            if t + 2 < tiles:
                                prow = fetch_rows(bx * tiles + t + 2, b)
                        for s in mine:
                            dots = torch.relu(q[s].double() @ k_s.double().T)  # [heads, bg]
                            sc = (w[s].double() @ dots * scale)[: len(cols)]
                            out[s, cols] = torch.where(cols < visible[s], sc, float("-inf"))
                    else:
                        for s in mine:
                            out[s, cols] = float("-inf")
    return out


@pytest.mark.parametrize("queries,tiles", [(1, 1), (1, 4), (2, 1), (2, 4)])
def test_indexer_fp4_schedule_scores_every_entry_from_its_own_tile(queries, tiles):
    """The kernel's schedule (prefetch across tiles, a pass per sequence in a block, per-query limits) modelled on
    the CPU against the torch op: every query's visible entries scored from their own keys, the rest -inf."""
    from deepinfer.kernels.torch import indexer as ref

    g = torch.Generator().manual_seed(queries * 10 + tiles)
    lengths, G = [3, 1, 6, 2], 700  # pairs straddle sequences; 700 = 5 tiles and a part
    B, n_q = len(lengths), sum(lengths)
    q_seq = torch.repeat_interleave(torch.arange(B), torch.tensor(lengths))
    visible = torch.tensor([700, 5, 129, 300, 1, 2, 128, 256, 640, 699, 700, 3])
    keys = quant.fake_quant_fp4(torch.randn(B * G, 128, generator=g), 32)
    rows = torch.randperm(B * G, generator=g).view(B, G)
    q = quant.fake_quant_fp4(torch.randn(n_q, 32, 128, generator=g), 32)
    w = torch.randn(n_q, 32, generator=g)
    got = _indexer_fp4_schedule(q, q_seq, visible.tolist(), keys, rows, w, 0.125, queries, tiles)
    want = ref.indexer_scores(q.double(), keys[rows].double(), q_seq, w.double(), 0.125)
    for s, n in enumerate(visible.tolist()):
        err = (got[s, :n] - want[s, :n].double()).norm() / want[s, :n].double().norm()
        assert err < 1e-6, (s, err)  # the reference's fp32 output
        assert torch.isneginf(got[s, n:]).all(), s
