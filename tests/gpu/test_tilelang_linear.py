"""FP8 linear (kernels/tilelang/linear.py + linear_kernel.py, gemv_kernel.py) against the dequantised-bf16 torch
path on random data (marker gpu): V4.1-Flash projection shapes and a small one, M from 1 to 1000, outputs poisoned
beforehand; a row's result is bitwise the same at every batch size and position and at every tile (the GEMM), at
every row count up to 8 (the GEMV); the registered `linear` op takes the GEMV up to 8 rows outside the invariant
mode, the GEMM otherwise (spied), and counts a fallback for inputs it does not cover; a dense bf16 weight's
fp32-output product (DSpark's Markov head) sums in fp32."""

import pytest
import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight

from ._helpers import fp8_blocks, poison_allocator, rel_err

pytestmark = pytest.mark.gpu

SHAPES = {  # name: (N, K)
    "small": (256, 512),
    "wq_a": (1280, 5120),
    "wq_b": (32768, 1280),
    "wkv": (512, 5120),
    "wo_a_group": (1024, 4096),
    "wo_b": (5120, 8192),
    "shared_w2": (5120, 2304),
}
ROWS = [1, 3, 8, 64, 256, 1000]
_WEIGHTS = {}


def _weight(name):
    """(Fp8BlockWeight, dequantised fp32) on the GPU, one shape at a time (the large ones are ~0.7 GB in fp32)."""
    if name not in _WEIGHTS:
        _WEIGHTS.clear()
        n, k = SHAPES[name]
        codes, scale, deq = fp8_blocks(n, k, torch.Generator(device="cuda").manual_seed(n + k))
        _WEIGHTS[name] = (Fp8BlockWeight(codes, scale), deq)
    return _WEIGHTS[name]


def _x(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").bfloat16()


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Every kernel the cases need, built on a thread pool first."""
    from concurrent.futures import ThreadPoolExecutor

    from deepinfer.kernels.tilelang._build import jit
    from deepinfer.kernels.tilelang.gemv_kernel import M_MAX, build_fp8_gemv
    from deepinfer.kernels.tilelang.linear import BLOCK_N, TILE_COUNTERS, WIDE_N, gemv_splits, split_count
    from deepinfer.kernels.tilelang.linear_kernel import (BLOCK_K, BLOCK_T, STAGES, build_fp8_linear,
                                                          build_split_reduce)

    specs = []
    for n, k in list(SHAPES.values()) + [(128, 5120)]:
        s = split_count(n, k)
        specs.append((build_fp8_linear, n, k, s))
        tiles = [(bt, WIDE_N) for bt in (16, 32)] if n % WIDE_N == 0 else [(BLOCK_T, BLOCK_N)]
        for fused in (((), (TILE_COUNTERS,)) if s > 1 else ((),)):
            specs += [(build_fp8_linear, n, k, s, bt, BLOCK_K, STAGES, 0, 1, bn) + fused for bt, bn in tiles]
        if s > 1:
            specs.append((build_split_reduce, n, s))
        g = gemv_splits(n, k)
        specs += [(build_fp8_gemv, n, k, m_max, g, 1) for m_max in M_MAX]
        if g > 1:
            specs.append((build_split_reduce, n, g))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda spec: jit(*spec), specs))


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_matches_the_dequantised_bf16_path(name, m):
    from deepinfer.kernels.tilelang.linear import fp8_linear, why_not

    w, deq = _weight(name)
    x = _x(m, w.shape[1], seed=m)
    assert why_not(x, w) is None
    out, ref = _checked(fp8_linear, x, w, deq)
    assert rel_err(out, ref) < 6e-3


def _checked(kernel, x, w, deq):
    """kernel(x, w) on a poisoned allocator, every element written and as close to the float64 product as cuBLAS on
    the dequantised bf16 weight (both round the fp32 sum to bf16 once: 2^-9 relative per element); (out, cuBLAS's)."""
    exact = x.double() @ deq.double().T
    ref = torch.nn.functional.linear(x, deq.bfloat16())  # the path without the kernel: cuBLAS on the bf16 weight
    poison_allocator()
    out = kernel(x, w)
    torch.cuda.synchronize()
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "an output element was never written (poisoned NaN)"
    assert rel_err(out, exact) <= max(1.5 * rel_err(ref, exact), 3e-3), (rel_err(out, exact), rel_err(ref, exact))
    return out, ref


@pytest.mark.parametrize("name", ["small", "wq_a", "wq_b", "wkv"])
def test_a_row_is_bitwise_the_same_at_every_batch_size_and_position(name):
    from deepinfer.kernels.tilelang.linear import fp8_linear

    w, _ = _weight(name)
    k = w.shape[1]
    x64 = _x(64, k, seed=7)
    out64 = fp8_linear(x64, w)
    for i in (0, 1, 31, 32, 63):  # first/last rows of both 32-token tiles
        assert torch.equal(fp8_linear(x64[i:i + 1].clone(), w)[0], out64[i]), i
    for m, at in ((3, 0), (256, 100), (1000, 936)):
        x = _x(m, k, seed=m)
        rows = min(64, m)
        x[at:at + rows] = x64[:rows]
        assert torch.equal(fp8_linear(x, w)[at:at + rows], out64[:rows]), (m, at)


@pytest.mark.parametrize("name", ["wq_a", "wkv", "wo_b", "shared_w2"])
def test_the_last_block_of_a_tile_sums_the_split_partials_as_the_reduce_launch_does(name, monkeypatch):
    """Split K: the tile's last block to finish adds the partials (linear.TILE_COUNTERS counters), bit for bit the
    separate split_reduce launch's result, at every row count, call after call and replayed from a CUDA graph
    (each tile's counter is back at zero after every call)."""
    from deepinfer.kernels.tilelang import linear

    w, _ = _weight(name)
    assert linear.split_count(*w.shape) > 1
    xs = {m: _x(m, w.shape[1], seed=100 + m) for m in (1, 8, 16, 17, 64, 200)}
    fused = {m: linear.fp8_linear(x, w) for m, x in xs.items()}
    again = {m: linear.fp8_linear(x, w) for m, x in xs.items()}
    x8 = xs[8]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear.fp8_linear(x8, w)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = linear.fp8_linear(x8, w)
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append(replayed.clone())
    torch.cuda.synchronize()
    assert not linear.tile_counters(x8.device).any()
    monkeypatch.setattr(linear, "TILE_COUNTERS", 0)  # the split_reduce launch
    for m, x in xs.items():
        ref = linear.fp8_linear(x, w)
        assert torch.equal(fused[m], ref) and torch.equal(again[m], ref), m
    assert all(torch.equal(r, fused[8]) for r in replays)


@pytest.mark.parametrize("tile", [(64, 64), (32, 128), (64, 128), (16, 128)])
@pytest.mark.parametrize("name", ["wq_b", "wkv", "wo_b"])
def test_every_tile_gives_a_row_the_same_bits(name, tile):
    """The tile only changes which block computes a row, never its K loop: the GEMM may pick tiles by M
    (linear.gemm_tiles) and keep the results of the 32 x 64 tile, bit for bit, at every row count."""
    from deepinfer.kernels.tilelang.linear import fp8_linear

    w, deq = _weight(name)
    for m in (5, 64, 200):
        x = _x(m, w.shape[1], seed=m + tile[0])
        out, _ = _checked(lambda x_, w_: fp8_linear(x_, w_, block_t=tile[0], block_n=tile[1]), x, w, deq)
        assert torch.equal(out, fp8_linear(x, w, block_t=32, block_n=64)), (m, tile)


def test_row_groups_run_the_kernel_on_views_and_match_the_whole():
    """wo_a as the model applies it: group g of [8 * 1024, 4096] through the kernel equals rows g of the whole."""
    from deepinfer.kernels.tilelang.linear import fp8_linear, why_not

    codes, scale, _ = fp8_blocks(8 * 1024, 4096, torch.Generator(device="cuda").manual_seed(3))
    whole = Fp8BlockWeight(codes, scale)
    x = _x(5, 4096, seed=3)
    full = fp8_linear(x, whole)
    for g, part in enumerate(whole.row_groups(8)):
        assert why_not(x, part) is None
        got = fp8_linear(x, part)
        # a view at a row offset reads the same bytes as a copy of the group (bits); the whole [8192, 4096] splits
        # K differently from one [1024, 4096] group (values)
        copy = Fp8BlockWeight(part.weight.clone(), part.scale.clone())
        assert torch.equal(got, fp8_linear(x, copy))
        assert rel_err(got, full[:, g * 1024:(g + 1) * 1024]) < 6e-3


@pytest.mark.parametrize("m", [1, 5, 64, 1100])  # 1100: the prefill path (one batched cuBLAS GEMM)
def test_the_grouped_projection_runs_every_group_in_one_launch_and_matches_the_groups(m):
    """wo_a through the registered `grouped_linear`: one kernel over [8 * 1024, 4096] with x [m, 8, 4096] (each
    weight tile reads its group's columns) equals the per-group reference; rows are bitwise the same at every
    batch size (the decode sizes); nothing falls back."""
    from deepinfer.kernels import registry
    from deepinfer.kernels.registry import OpSet
    from deepinfer.kernels.torch.linear import grouped_linear as reference

    ops = OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]})
    codes, scale, _ = fp8_blocks(8 * 1024, 4096, torch.Generator(device="cuda").manual_seed(m))
    groups = Fp8BlockWeight(codes, scale).row_groups(8)
    x = _x(m * 8, 4096, seed=m).view(m, 8, 4096)
    before = registry.fallback_counts().get("grouped_linear", {})
    poison_allocator()
    got = ops.grouped_linear(x, groups)
    assert registry.fallback_counts().get("grouped_linear", {}) == before
    assert got.shape == (m, 8 * 1024) and torch.isfinite(got).all()
    assert rel_err(got, reference(x, groups)) < 6e-3
    if m <= 64:  # up to GEMV_ROWS rows both calls take the GEMV, beyond it the GEMM: a row against the same kernel
        from deepinfer.kernels.tilelang.linear import GEMV_ROWS, fp8_linear
        for i in {0, m // 2, m - 1}:
            one = x[i:i + 1].clone()
            alone = (ops.grouped_linear(one, groups)[0] if m <= GEMV_ROWS
                     else fp8_linear(one.reshape(1, 8 * 4096), groups.whole, groups=8)[0])
            assert torch.equal(alone, got[i])


def test_groups_the_kernel_cannot_tile_go_to_the_torch_op_counted():
    """Row groups of 32 rows (whole scale blocks, but not whole 64-row tiles: a small model's wo_a) are a counted
    fallback with the torch op's result, not a failed launch."""
    from deepinfer.kernels import registry
    from deepinfer.kernels.registry import OpSet
    from deepinfer.kernels.torch.linear import grouped_linear as reference

    ops = OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]})
    codes, scale, _ = fp8_blocks(4 * 32, 128, torch.Generator(device="cuda").manual_seed(3))
    groups = Fp8BlockWeight(codes, scale).row_groups(4)
    x = _x(3 * 4, 128, seed=3).view(3, 4, 128)
    before = sum(registry.fallback_counts().get("grouped_linear", {}).values())
    got = ops.grouped_linear(x, groups)
    assert sum(registry.fallback_counts().get("grouped_linear", {}).values()) == before + 1
    assert torch.equal(got, reference(x, groups))


def test_registered_op_takes_the_kernel_for_fp8_and_counts_what_it_cannot_take(monkeypatch):
    from deepinfer.kernels import registry
    from deepinfer.kernels.registry import OpSet
    from deepinfer.kernels.tilelang import linear as launcher

    ops = OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]})
    assert ops.chosen["linear"] == "tilelang-sm90"
    calls = []
    for name in ("fp8_linear", "fp8_gemv"):  # either kernel counts as the kernel path
        real = getattr(launcher, name)
        monkeypatch.setattr(launcher, name, lambda *a, real=real, **kw: calls.append(1) or real(*a, **kw))
    w, deq = _weight("small")
    x = _x(4, 512, seed=1)
    out = ops.linear(x.view(2, 2, 512), w)
    assert calls and out.shape == (2, 2, 256)
    before = registry.fallback_counts().get("linear", {})
    y32 = ops.linear(x.float(), w)  # fp32 activations: the torch op on the dequantised weight
    after = registry.fallback_counts().get("linear", {})
    assert sum(after.values()) == sum(before.values()) + 1 and len(calls) == 1
    assert torch.equal(y32, torch.nn.functional.linear(x.float(), deq))
    dense = ops.linear(x, deq.bfloat16())  # a dense weight is cuBLAS by design, not a counted fallback
    assert sum(registry.fallback_counts().get("linear", {}).values()) == sum(after.values())
    assert rel_err(dense, out.view(4, 256)) < 6e-3


# ---- the GEMV for a few rows (gemv_kernel.py) ------------------------------------------------------------------
GEMV_SHAPES = {**SHAPES, "narrow": (128, 5120)}  # narrow: 32 blocks of 4 rows, so K is split (partials + reduce)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("name", list(GEMV_SHAPES))
def test_the_gemv_matches_the_dequantised_bf16_path_and_the_gemm(name, m):
    from deepinfer.kernels.tilelang.linear import fp8_gemv, fp8_linear, why_not

    if name == "narrow":
        n, k = GEMV_SHAPES[name]
        codes, scale, deq = fp8_blocks(n, k, torch.Generator(device="cuda").manual_seed(n + k))
        w = Fp8BlockWeight(codes, scale)
    else:
        w, deq = _weight(name)
    x = _x(m, w.shape[1], seed=m + 11)
    assert why_not(x, w) is None
    out, _ = _checked(fp8_gemv, x, w, deq)
    assert rel_err(out, fp8_linear(x, w)) < 6e-3  # the GEMM: the same sums in another order


@pytest.mark.parametrize("name", ["small", "wq_b", "wo_b"])
def test_a_gemv_row_is_bitwise_the_same_at_every_row_count(name):
    from deepinfer.kernels.tilelang.linear import fp8_gemv

    w, _ = _weight(name)
    x8 = _x(8, w.shape[1], seed=5)
    out8 = fp8_gemv(x8, w)
    for m in (1, 2, 3, 4, 7):
        for i in {0, m - 1}:
            rows = x8[i:i + m].clone() if i + m <= 8 else x8[8 - m:].clone()
            at = i if i + m <= 8 else 8 - m
            assert torch.equal(fp8_gemv(rows, w), out8[at:at + m]), (m, i)


def test_the_linear_op_takes_the_gemv_at_one_row_and_the_gemm_in_the_invariant_mode(monkeypatch):
    from deepinfer.kernels.registry import OpSet
    from deepinfer.kernels.tilelang import linear as launcher

    w, _ = _weight("wq_a")
    seen = []
    for name in ("fp8_linear", "fp8_gemv"):
        real = getattr(launcher, name)
        monkeypatch.setattr(launcher, name, lambda *a, real=real, name=name, **kw: seen.append(name) or real(*a, **kw))
    ops = OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]})
    assert launcher.GEMV_ROWS == 1  # the H200 crossover (linear_gpu.py: the GEMV ties the GEMM at two rows)
    for m in (1, 2, 9):
        ops.linear(_x(m, w.shape[1], seed=m), w)
    assert seen == ["fp8_gemv", "fp8_linear", "fp8_linear"]
    seen.clear()
    ops = OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]}, batch_invariant=True)
    try:
        ops.linear(_x(1, w.shape[1], seed=1), w)
    finally:
        OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]}, batch_invariant=False)
    assert seen == ["fp8_linear"]


def test_fp32_output_from_bf16_operands_sums_in_fp32_and_keeps_rows_in_the_invariant_mode():
    """DSpark's Markov bias: the bf16 [V, rank] table as stored times bf16 rows, fp32 logits (cuBLAS by design,
    no fallback counted): within fp32 summation error of the float64 product, not rounded to bf16; in the invariant
    mode a row's bits do not follow the row count."""
    from deepinfer.kernels.registry import OpSet, fallback_counts

    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(64, 256, generator=gen, device="cuda").bfloat16()
    w = torch.randn(129280, 256, generator=gen, device="cuda").bfloat16()
    ops = OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]})
    before = fallback_counts()
    for m in (1, 6, 64):
        out = ops.linear(x[:m], w, out_dtype=torch.float32)
        assert out.dtype == torch.float32 and out.shape == (m, 129280)
        ref = x[:m].double() @ w.double().t()
        bound = 256 * 2.0 ** -24 * (x[:m].double().abs() @ w.double().abs().t())  # fp32 sums of exact products
        assert ((out.double() - ref).abs() <= bound).all(), m
        assert not torch.equal(out, out.bfloat16().float())  # not rounded to bf16 on the way
    assert fallback_counts() == before
    ops = OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]}, batch_invariant=True)
    try:
        rows = [ops.linear(x[:m], w, out_dtype=torch.float32) for m in (1, 6, 64)]
    finally:
        OpSet.build("cuda", {"default": ["tilelang-sm90", "torch"]}, batch_invariant=False)
    assert torch.equal(rows[0], rows[1][:1]) and torch.equal(rows[1], rows[2][:6])
