"""CPU checks of the FP8 linear (kernels/tilelang/linear_kernel.py, launcher linear.py): the kernel and its split
reduction lower to CUDA for sm_90a (wgmma with the dequantised weights as the register A operand) and sm_100a,
and the launcher picks one kernel configuration per weight shape whatever the batch size (the batch-invariance
precondition; the GPU test checks the bits)."""

import importlib.util
import shutil

import pytest
import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight

tilelang_missing = importlib.util.find_spec("tilelang") is None
pytestmark = pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")

# V4.1-Flash projections: (N, K)
FLASH = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_a_group": (1024, 4096),
         "wo_b": (5120, 8192), "shared_w13": (2304, 5120), "shared_w2": (5120, 2304)}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", ["wq_a", "wq_b"])  # split K (partials) and unsplit (bf16 out)
def test_fp8_linear_lowers_to_cuda(name, arch):
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.linear import split_count
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_T, build_fp8_linear

    n, k = FLASH[name]
    src = lower_source(build_fp8_linear(n, k, split_count(n, k)), arch)
    assert "__global__" in src and "di3_group<1," in src and "di3_permute_x<" in src  # FP8 (format 1) fragments
    if arch == "sm_90a":
        assert f"wgmma.mma_async.sync.aligned.m64n{BLOCK_T}k16.f32.bf16.bf16" in src and "wgmma.wait_group" in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src  # the non-Hopper fallback


def test_the_64_token_tile_lowers():
    """The token tile prefill_kernels_gpu.py --linear-block-t times against the default 32 (verification sizes)."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.linear import split_count
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_K, STAGES, build_fp8_linear

    n, k = FLASH["wo_b"]
    src = lower_source(build_fp8_linear(n, k, split_count(n, k), 64, BLOCK_K, STAGES, 0, 1), "sm_90a")
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in src


def test_the_two_warpgroup_tiles_lower_to_one_activation_tile_for_128_weight_rows():
    """gemm_tiles' blocks: 256 threads, 16 or 32 tokens, each warpgroup its 64 rows against the shared tile."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.linear import WIDE_N, split_count
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_K, STAGES, build_fp8_linear

    n, k = FLASH["wq_b"]
    for bt in (16, 32):
        src = lower_source(build_fp8_linear(n, k, split_count(n, k), bt, BLOCK_K, STAGES, 0, 1, WIDE_N), "sm_90a")
        assert f"wgmma.mma_async.sync.aligned.m64n{bt}k16.f32.bf16.bf16" in src
        assert "__launch_bounds__(256" in src


def test_the_grouped_output_projection_lowers_as_one_kernel_reading_its_groups_columns():
    """wo_a's 8 groups in one launch: a block of weight tile bn reads x's columns of group bn // 16."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.linear import split_count
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_K, BLOCK_T, STAGES, build_fp8_linear

    n, k = FLASH["wo_a_group"]
    src = lower_source(build_fp8_linear(8 * n, k, split_count(8 * n, k), BLOCK_T, BLOCK_K, STAGES, 0, 8), "sm_90a")
    load = next(line for line in src.splitlines() if "(&(x[" in line)
    assert "* (int64_t)32768)" in load  # x rows of 8 x 4096
    assert "(((int64_t)((int)blockIdx.y)) >> (int64_t)4) * (int64_t)4096)" in load  # group = tile // 16


def test_split_reduce_lowers_and_sums_in_split_order():
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.linear_kernel import build_split_reduce

    src = lower_source(build_split_reduce(1280, 10), "sm_90a")
    assert "__global__" in src and "for (int s = 0; s < 10; ++s)" in src and "atomic" not in src.lower()


def test_every_flash_shape_is_covered_with_enough_blocks():
    """Splits fill ~2 blocks per SM where the K steps allow it (wkv: 8 weight tiles, at most 16 splits)."""
    from deepinfer.kernels.tilelang.linear import BLOCK_N, split_count
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_K

    want = {"wq_a": 10, "wq_b": 1, "wkv": 10, "wo_a_group": 16, "wo_b": 4, "shared_w13": 8, "shared_w2": 6}
    for name, (n, k) in FLASH.items():
        assert n % BLOCK_N == 0 and k % (BLOCK_K * want[name]) == 0
        assert split_count(n, k) == want[name], name


def _specs_by_rows(monkeypatch, n, k, rows=(1, 3, 8, 63, 64, 256, 1000)):
    """{m: the jit specs fp8_linear launches at m rows} (recorded, nothing runs)."""
    from deepinfer.kernels.tilelang import linear as launcher

    specs = {}

    def fake_jit(builder, *args):
        specs[m].append((builder.__name__, args))
        return lambda *tensors: None  # record only: no GPU here

    monkeypatch.setattr(launcher, "jit", fake_jit)
    w = Fp8BlockWeight(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n // 32, k // 32, dtype=torch.uint8))
    for m in rows:
        specs[m] = []
        launcher.fp8_linear(torch.zeros(m, k, dtype=torch.bfloat16), w)
    return specs


def test_the_k_splits_and_their_reduction_follow_the_weight_shape_alone(monkeypatch):
    """At every M the same K split and split reduction; only the tile follows M (16 x 128 up to 16 rows, 32 x 128
    beyond), which moves a row to another block without changing its K loop (the GPU test checks the bits)."""
    from deepinfer.kernels.tilelang.linear import WIDE_N

    for n, k in FLASH.values():
        specs = _specs_by_rows(monkeypatch, n, k)
        assert len({(kern[0][1][:3], tuple(kern[1:])) for kern in specs.values()}) == 1, (n, k)
        for m, kern in specs.items():
            tile = kern[0][1][3:4] + kern[0][1][8:9]
            want = ((16 if m <= 16 else 32), WIDE_N) if n % WIDE_N == 0 else ()
            assert tile == want, (n, k, m, kern)


def test_a_split_gemm_sums_its_partials_in_its_own_last_block_up_to_the_counters_it_has(monkeypatch):
    """Split K at decode and verification sizes: one launch, the tile's last block to finish adding the partials
    (fused_reduce = the counters' count); beyond TILE_COUNTERS output tiles the separate split_reduce launch, which
    adds the same partials in the same order."""
    from deepinfer.kernels.tilelang import linear as launcher

    n, k = FLASH["wq_a"]
    specs = _specs_by_rows(monkeypatch, n, k, rows=(1, 8, 1000))
    assert all(len(kern) == 1 and kern[0][1][2] == 10 and kern[0][1][-1] == launcher.TILE_COUNTERS
               for kern in specs.values())
    monkeypatch.setattr(launcher, "TILE_COUNTERS", 10)  # wq_a beyond 16 rows: 32 x 128 tiles, 10 per token tile
    specs = _specs_by_rows(monkeypatch, n, k, rows=(32, 33))
    assert specs[32][0][1][-1] == 10 and len(specs[32]) == 1
    assert len(specs[33][0][1]) == 9 and specs[33][1] == ("build_split_reduce", (n, 10))


def test_the_fused_split_reduction_lowers_to_a_counted_hand_over_and_a_split_order_sum():
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.linear import TILE_COUNTERS, WIDE_N, split_count
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_K, STAGES, build_fp8_linear

    n, k = FLASH["wq_a"]
    src = lower_source(build_fp8_linear(n, k, split_count(n, k), 16, BLOCK_K, STAGES, 0, 1, WIDE_N, TILE_COUNTERS),
                       "sm_90a")
    body = src[src.index("__global__"):]
    fence, arrive = body.index("__threadfence();"), body.index("AtomicAddRet(")
    assert fence < body.index("__syncthreads();", fence) < arrive  # every thread's stores fenced before it counts
    assert "== 9)" in body[arrive:]  # the tenth of ten splits to arrive sums
    assert "for (int s = 0; s < 10; ++s)" in body and "di_ld_cg(" in body  # split order, past L1
    assert "] = 0;" in body[arrive:]  # and resets its tile's counter for the next launch


def test_the_invariant_mode_uses_one_kernel_configuration_for_every_batch_size(monkeypatch):
    from deepinfer.kernels import registry

    monkeypatch.setattr(registry, "batch_invariant", lambda: True)
    monkeypatch.setattr("deepinfer.kernels.tilelang.linear.batch_invariant", lambda: True)
    for n, k in FLASH.values():
        specs = _specs_by_rows(monkeypatch, n, k)
        assert len({tuple(kern) for kern in specs.values()}) == 1, (n, k)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_fp8_linear_sm90_machine_code(tmp_path):
    """ptxas: no spills, registers within the occupancy the launch bounds ask for, no serialized wgmma."""
    from lowering_helpers import lower_source, ptxas_report
    from deepinfer.kernels.tilelang.linear_kernel import BLOCK_K, BLOCK_T, STAGES, build_fp8_linear
    from deepinfer.kernels.tilelang.moe_kernel import shared_bytes

    log, regs = ptxas_report(lower_source(build_fp8_linear(1280, 5120, 10), "sm_90a"), tmp_path)
    assert "0 bytes spill stores" in log and "serialized" not in log, log[-2000:]
    blocks = min(4, (227 * 1024) // (shared_bytes("fp8", BLOCK_T, BLOCK_K, STAGES) + 1024))
    assert regs * 128 * blocks <= 65536, (regs, blocks)


# ---- the GEMV for a few rows (gemv_kernel.py) ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name,m_max", [("wq_a", 1), ("wq_b", 8), ("wo_b", 4)])
def test_the_gemv_lowers_to_one_load_per_chunk_and_a_shuffle_sum(name, m_max, arch):
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.gemv_kernel import build_fp8_gemv, chunk_width

    n, k = FLASH[name]
    src = lower_source(build_fp8_gemv(n, k, m_max), arch)
    vec = chunk_width(k)
    load = "*(fp8_e4_16_t*)(wl" if vec == 16 else "*(fp8_e4_8_t*)(wl"
    assert "__global__" in src and load in src and "__shfl_xor_sync" in src
    assert "__tl_cvt_fp8x2_to_half2" in src  # the hardware's e4m3 conversion, two codes an instruction
    assert "wgmma" not in src and "__shared__" not in src  # registers only: no tiles, no shared memory
    assert "atomic" not in src.lower()


def test_the_gemv_groups_read_their_groups_columns_and_splits_write_partials():
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.gemv_kernel import build_fp8_gemv

    n, k = FLASH["wo_a_group"]
    src = lower_source(build_fp8_gemv(8 * n, k, 1, 1, 8), "sm_90a")
    load = next(line for line in src.splitlines() if "*)(x + " in line)
    assert "((((int)blockIdx.x) >> 8) * 4096)" in load  # group = row // 1024 = block // 256, its first column
    src = lower_source(build_fp8_gemv(512, 5120, 2, 2), "sm_90a")
    assert "float* __restrict__ out" in src  # fp32 partials [splits, m, N]


def test_e4m3_codes_are_f16_values_so_the_gemv_conversion_is_exact():
    """The GEMV converts e4m3 to f16, then to fp32: every finite code (subnormals included) is an f16 value."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    ok = ~torch.isnan(want)
    assert int(ok.sum()) == 254 and torch.equal(codes.half().float()[ok], want[ok])


def test_ue8m0_scales_by_bit_placement_are_powers_of_two():
    s = torch.arange(256, dtype=torch.int32)
    got = torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22)).view(torch.float32).double()
    assert torch.equal(got[:255], torch.exp2(s[:255].double() - 127))


def test_the_launcher_takes_the_gemv_at_one_row_and_never_in_the_invariant_mode(monkeypatch):
    """One row: the H200 crossover (linear_gpu.py: the GEMV ties the GEMM at two rows, loses from four)."""
    from deepinfer.kernels import registry
    from deepinfer.kernels.tilelang import linear as launcher

    n, k = FLASH["wq_a"]
    w = Fp8BlockWeight(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n // 32, k // 32, dtype=torch.uint8))
    assert launcher.gemv_fits(w) and [m for m in range(0, 12) if launcher._gemv_ok(m, w)] == [1]
    monkeypatch.setitem(registry._MODE, "batch_invariant", True)
    assert not any(launcher._gemv_ok(m, w) for m in range(12))


def test_the_gemv_splits_k_only_for_narrow_weights(monkeypatch):
    """wkv (512 rows: 128 blocks of 4 rows) runs whole; a 128-row weight splits its K to reach ~one block per SM;
    every Flash shape's jit spec is one per row-count variant, the split fixed by the shape."""
    from deepinfer.kernels.tilelang import linear as launcher

    assert {name: launcher.gemv_splits(*FLASH[name]) for name in FLASH} == dict.fromkeys(FLASH, 1)
    assert launcher.gemv_splits(128, 5120) == 5  # 32 blocks x 5 >= 128
    specs = []
    monkeypatch.setattr(launcher, "jit", lambda builder, *a: specs.append((builder.__name__, a)) or (lambda *t: None))
    w = Fp8BlockWeight(torch.zeros(128, 5120, dtype=torch.uint8), torch.zeros(4, 160, dtype=torch.uint8))
    launcher.fp8_gemv(torch.zeros(3, 5120, dtype=torch.bfloat16), w)
    assert specs == [("build_fp8_gemv", (128, 5120, 4, 5, 1, False)), ("build_split_reduce", (128, 5))]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("m_max", [1, 8])
def test_the_gemv_machine_code(m_max, tmp_path):
    """ptxas: the widest row (wo_b, K = 8192: 16 loads a lane in flight) in registers, no spills."""
    from lowering_helpers import lower_source, ptxas_report
    from deepinfer.kernels.tilelang.gemv_kernel import build_fp8_gemv

    log, regs = ptxas_report(lower_source(build_fp8_gemv(*FLASH["wo_b"], m_max), "sm_90a"), tmp_path)
    assert "0 bytes spill stores" in log, log[-2000:]
    # at one row under 255: the integer decode took all 255 (8 warps an SM); the hardware conversion needs fewer
    assert regs <= (200 if m_max == 1 else 255), regs


def test_the_launcher_asks_for_the_gemv_by_the_manifests_spec(monkeypatch):
    """The spec benchmarks/jit/flash40.jsonl lists for a one-row GEMV: (N, K, m_max, splits, groups, early)."""
    from deepinfer.kernels.tilelang import linear as launcher

    specs = []
    monkeypatch.setattr(launcher, "jit", lambda builder, *a: specs.append(a) or (lambda *t: None))

    def spec(name):
        n, k = FLASH[name]
        w = Fp8BlockWeight(torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n // 32, k // 32, dtype=torch.uint8))
        launcher.fp8_gemv(torch.zeros(1, k, dtype=torch.bfloat16), w)
        return specs.pop()

    assert spec("wo_b") == (5120, 8192, 1, 1, 1, False) and spec("wq_b") == (32768, 1280, 1, 1, 1, False)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_dense_dequantisation_lowers_to_one_pass_of_16_byte_loads_and_hardware_conversions(arch):
    """fp8_dense_kernel.py (the projections' weight for cuBLAS from linear.DENSE_ROWS rows): 16 codes a thread in
    one load, converted two at a time by the e4m3x2 cvt, written by vector stores."""
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.fp8_dense_kernel import build_fp8_dense

    n, k = FLASH["wq_b"]
    src = lower_source(build_fp8_dense(n, k), arch)
    assert "__global__" in src and "fp8_e4_16_t" in src and "cvt_fp8x2_to_half2" in src
    # the 32 output bytes as vector stores: two 16-byte ones (sm_90a), one 32-byte one (sm_100a)
    assert src.count("*(uint4*)(out") == 1 or src.count("*(ulonglong4*)(out") == 1


def test_the_launcher_multiplies_the_dense_weight_from_the_row_threshold_only_outside_the_invariant_mode(monkeypatch):
    """linear(): the GEMV at one row, the weight-only kernel below dense_rows(N, K) (128 rows for weights of 2^25
    codes or more, 256 for smaller ones), the dense bf16 weight (cuBLAS) from there, never in the batch-invariant
    mode (cuBLAS picks its kernel by the row count). Recorded on the CPU: the dispatch only."""
    from deepinfer.kernels.tilelang import linear as launcher

    calls = []
    monkeypatch.setattr(launcher, "why_not", lambda x, w: None)
    monkeypatch.setattr(launcher, "fp8_linear", lambda x, w: calls.append("kernel"))
    monkeypatch.setattr(launcher, "fp8_gemv", lambda x, w: calls.append("gemv"))
    monkeypatch.setattr(launcher, "dense_bf16", lambda w: calls.append("dense") or "the dense weight")
    # cuBLAS's GEMM, not run: a 256 x 32768 x 1280 bf16 GEMM took 45 s of a CPU test
    monkeypatch.setattr(launcher.torch.nn.functional, "linear",
                        lambda x, w: calls.append("cublas") if w == "the dense weight" else None)
    for (n, k), rows in (((1280, 5120), launcher.DENSE_ROWS), ((32768, 1280), launcher.DENSE_ROWS_LARGE)):
        w = Fp8BlockWeight(torch.zeros(n, k, dtype=torch.uint8), torch.full((n // 32, k // 32), 127, dtype=torch.uint8))
        assert launcher.dense_rows(n, k) == rows
        calls.clear()
        for m in (1, rows - 1, rows):
            launcher.linear(torch.zeros(m, k, dtype=torch.bfloat16), w)
        assert calls == ["gemv", "kernel", "dense", "cublas"]
        calls.clear()
        monkeypatch.setattr(launcher, "batch_invariant", lambda: True)
        launcher.linear(torch.zeros(rows, k, dtype=torch.bfloat16), w)
        monkeypatch.setattr(launcher, "batch_invariant", lambda: False)
        assert calls == ["kernel"]


def test_the_shared_expert_for_cublas_keeps_the_packed_values_off_the_kernel_path():
    """linear.expert_dense on the CPU (dense_bf16's torch passes): PackedExperts.dense's values, bit for bit, so the
    one-pass kernel (tests/gpu) and the CPU agree on what the shared expert's dense path multiplies."""
    from deepinfer.kernels.packed_experts import pack_experts
    from deepinfer.kernels.tilelang.linear import expert_dense

    g = torch.Generator().manual_seed(0)

    def fp8(rows, cols):
        codes = (torch.randn(rows, cols, generator=g) * 30).to(torch.float8_e4m3fn).view(torch.uint8)
        return codes, torch.randint(110, 130, (rows // 32, cols // 32), dtype=torch.uint8, generator=g)

    (a, sa), (b, sb), (c, sc) = fp8(64, 96), fp8(64, 96), fp8(96, 64)
    shared = pack_experts("fp8", [a], [sa], [b], [sb], [c], [sc])
    w13, w2 = expert_dense(shared, 0, torch.bfloat16)
    w1, w3 = shared.split_w13(w13)
    for got, ref in zip((w1, w2, w3), shared.dense(0, torch.bfloat16)):
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), ref.view(torch.int16))
