"""The one-launch kernels that replace chains of kernels compute the chains' bits: each side's generated CUDA source
runs on the CPU under tests/cuda_emulation.py (the same emulated intrinsics for both), so the lane orders, the
folds, the RoPE pairs, the quantiser's blocks and the stores are checked without a GPU (slow: a thread per CUDA
thread). tests/gpu holds the same claims on the H200.

* window_kv (window_kv_kernel.py) = rms_norm (block or warp kernel, by ATen's lane count) -> rope -> the FP8
  encode -> the ring's index_copy_ writes;
* mhc_collapse_norm (collapse_norm_kernel.py) = mhc_collapse -> rms_norm;
* moe_prep with zero_cols: the routing table of moe_table's torch sorts, and its output zeroed by the extra blocks.

The reduction orders are held to weakly here: a changed fp32 sum of squares moves a bf16 output only where a value
sits at a rounding boundary; the one statistic macro all three norm kernels expand (rowwise_kernel.rms_rstd) and
the GPU tests carry that claim.
"""

import importlib.util

import pytest
import torch

from cuda_emulation import compile_kernel, gxx_ok

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed"),
    pytest.mark.skipif(not gxx_ok(), reason="needs g++ with C++20 <barrier>"),
]

EPS = 1e-6


def _lowered(prim_func):
    from lowering_helpers import lower_source

    return lower_source(prim_func, "sm_90a")


@pytest.fixture(scope="module")
def norm_kernels(tmp_path_factory):
    from deepinfer.kernels.tilelang import rowwise_kernel as k

    d = tmp_path_factory.mktemp("norms")
    return {dim: (compile_kernel(_lowered(k.build_rms_norm_block(dim)), d, f"block{dim}")[0],
                  compile_kernel(_lowered(k.build_rms_norm_warp(dim)), d, f"warp{dim}")[0])
            for dim in (512, 1280)}


def _rms_norm(norm_kernels, x, w):
    """rowwise.rms_norm's kernel choice and launch, emulated."""
    from deepinfer.kernels.tilelang.rowwise import torch_reduce_lanes

    rows, dim = x.shape
    lanes = torch_reduce_lanes(dim, rows)
    block, warp = norm_kernels[dim]
    out = torch.empty_like(x)
    if lanes == 32:
        warp(-(-rows // 4), out=out, w=w, x=x, eps=EPS, rows=rows)
    else:
        block(rows, out=out, w=w, x=x, eps=EPS, lanes=lanes, rows=rows)
    return out, lanes


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 16, 20])
def test_window_kv_writes_the_ring_bytes_of_norm_rope_and_encode(rows, norm_kernels, tmp_path):
    from deepinfer.kernels.tilelang import rowwise_kernel as k
    from deepinfer.kernels.tilelang.window_kv_kernel import build_window_kv
    from deepinfer.kernels.torch.rope import default_inv_freq

    dim, rd, ring_rows = 512, 64, 40
    rope, _ = compile_kernel(_lowered(k.build_rope(dim, rd, False)), tmp_path)
    encode, _ = compile_kernel(_lowered(k.build_fake_quant("fp8", 32, 256, 2, True)), tmp_path)
    fused, _ = compile_kernel(_lowered(build_window_kv(dim, rd)), tmp_path)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, dim, generator=g) * torch.logspace(-2, 2, rows)[:, None]).bfloat16()
    x[:, :5] *= 200.0
    w = (1 + 0.3 * torch.randn(dim, generator=g)).bfloat16()
    pos = torch.randint(0, 1 << 20, (rows,), generator=g)
    inv = default_inv_freq(10000.0, rd)
    write = torch.randperm(ring_rows - 1, generator=g)[:rows]
    write[rows // 2:] = torch.where(torch.rand(rows - rows // 2, generator=g) < 0.3, ring_rows - 1,
                                    write[rows // 2:])  # some tokens write the trash row
    ref_codes = torch.randint(0, 256, (ring_rows, dim), dtype=torch.uint8, generator=g)
    ref_scale = torch.randint(0, 256, (ring_rows, dim // 32), dtype=torch.uint8, generator=g)
    got_codes, got_scale = ref_codes.clone(), ref_scale.clone()

    y, lanes = _rms_norm(norm_kernels, x, w)
    r = torch.empty_like(y)
    rope(-(-rows * (dim // 8) // (128 * 4)), inv_freq=inv, out=r, pos=pos, x=y, heads=1, n_pos=rows, rows=rows)
    n_chunks = rows * dim // 8
    codes, scale = torch.empty(n_chunks, 8, dtype=torch.uint8), torch.empty(n_chunks // 4, dtype=torch.uint8)
    encode(-(-n_chunks // 512), codes=codes, out=torch.empty(n_chunks, 8, dtype=torch.bfloat16), scale=scale,
           x=r.view(-1, 8), n_blocks=n_chunks // 4, n_chunks=n_chunks)
    ref_codes.index_copy_(0, write, codes.view(rows, dim))
    ref_scale.index_copy_(0, write, scale.view(rows, dim // 32))

    fused(rows, inv_freq=inv, pos=pos, ring_codes=got_codes, ring_scale=got_scale, w=w, write_row=write, x=x,
          eps=EPS, lanes=lanes, ring_rows=ring_rows, rows=rows)
    keep = slice(0, ring_rows - 1)  # the trash row: any of its writers' bytes
    assert torch.equal(got_codes[keep], ref_codes[keep]), (rows, lanes, int((got_codes != ref_codes).sum()))
    assert torch.equal(got_scale[keep], ref_scale[keep]), (rows, lanes)


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 16, 18])
def test_collapse_norm_is_the_collapse_then_the_norm(rows, norm_kernels, tmp_path):
    from deepinfer.kernels.tilelang.collapse_norm_kernel import build_mhc_collapse_norm
    from deepinfer.kernels.tilelang.mhc import _block_d
    from deepinfer.kernels.tilelang.mhc_kernel import build_mhc_collapse

    hc, dim = 4, 1280
    bd = _block_d(dim)
    collapse, _ = compile_kernel(_lowered(build_mhc_collapse(hc, dim, bd, bd // 8)), tmp_path)
    fused, _ = compile_kernel(_lowered(build_mhc_collapse_norm(hc, dim)), tmp_path)
    g = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, hc, dim, generator=g) * torch.logspace(-1, 1, rows)[:, None, None]).bfloat16()
    pre = torch.rand(rows, hc, generator=g) + 1e-6
    w = (1 + 0.3 * torch.randn(dim, generator=g)).bfloat16()

    c = torch.empty(rows, dim, dtype=torch.bfloat16)
    collapse(rows * (dim // bd), out=c, pre=pre, x=x, n_tok=rows)
    ref, lanes = _rms_norm(norm_kernels, c, w)
    got = torch.empty(rows, dim, dtype=torch.bfloat16)
    fused(rows, out=got, pre=pre, w=w, x=x, eps=EPS, lanes=lanes, rows=rows)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (rows, lanes, int((got != ref).sum()))


@pytest.mark.parametrize("tokens", [1, 7, 90])
def test_the_zeroing_prep_kernel_builds_the_table_and_zeroes_the_output(tokens, tmp_path):
    from deepinfer.kernels.tilelang.moe_prep_kernel import ZERO_PER, build_moe_prep
    from deepinfer.kernels.tilelang.moe_table import routing_table_torch

    E, k, D = 384, 6, 512
    prep, _ = compile_kernel(_lowered(build_moe_prep(E, k, D)), tmp_path)
    g = torch.Generator().manual_seed(tokens)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    idx.view(-1)[torch.randperm(idx.numel(), generator=g)[: tokens // 3]] = -1  # no expert: left out
    weights = torch.rand(tokens, k, generator=g)
    n_slots = min(E, tokens * k)
    out = dict(rows=torch.full((tokens * k,), -7, dtype=torch.int32), aw=torch.full((tokens * k,), -7.0),
               slot_expert=torch.full((n_slots,), -7, dtype=torch.int32),
               slot_start=torch.full((n_slots,), -7, dtype=torch.int32),
               slot_count=torch.full((n_slots,), -7, dtype=torch.int32),
               zero=torch.full((tokens * D // 4, 4), float("nan")))
    blocks = 1 + -(-tokens * D // 4 // (384 * ZERO_PER))
    prep(blocks, idx=idx, weights=weights, n_slots=n_slots, n_tok=tokens, **out)
    assert torch.equal(out["zero"], torch.zeros_like(out["zero"]))
    want = routing_table_torch(idx, weights, E)
    n = int((idx >= 0).sum())
    assert torch.equal(out["rows"][:n], want[0][:n]) and torch.equal(out["aw"][:n], want[1][:n])
    for name, w in zip(("slot_expert", "slot_start", "slot_count"), want[2:]):
        assert torch.equal(out[name], w), name
