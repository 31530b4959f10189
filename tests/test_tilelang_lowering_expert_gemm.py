"""CPU checks of the prefill MoE's FP4 grouped GEMM (kernels/tilelang/expert_gemm_kernel.py), no GPU needed: at the
released widths it lowers to wgmma with the dequantised weights in registers and the tokens on N, its build keeps
the MMAs pipelined (ptxas serialises none) without spilling, and it still lowers (mma.sync) for sm_100a. The GPU
test holds its numbers to moe_prefill.expert_gemm_torch."""

import importlib.util
import shutil

import pytest

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

# V4.1-Flash's gate/up and down projections at both tile heights
SHAPES = [(4608, 5120, "swiglu", 128), (5120, 2304, "plain", 128), (4608, 5120, "swiglu", 64),
          (5120, 2304, "plain", 64)]


@needs_tilelang
@pytest.mark.parametrize("n,k,epilogue,block_t", SHAPES[:3])
def test_it_dequantises_into_wgmma_fragments_with_the_tokens_on_n(n, k, epilogue, block_t):
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm

    src = lower_source(build_fp4_expert_gemm(n, k, epilogue, block_t=block_t, stages=3), "sm_90a")
    assert f"wgmma.mma_async.sync.aligned.m64n{block_t}k16.f32.bf16.bf16" in src  # A from registers, tokens on N
    assert f"xrs_mainloop<{block_t},3>(" in src and "di3_e2m1x8(p0.x, s0, d0);" in src
    assert "(1ull << 62)" in src  # the activation tile's descriptor: 128-byte swizzle
    assert "wgmma_ss" not in src and "w_s" not in src  # no dequantised weight tile in shared memory


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("n,k,epilogue,block_t", SHAPES)
def test_its_mmas_stay_pipelined_in_the_registers_its_launch_bounds_leave(n, k, epilogue, block_t, tmp_path):
    """ptxas serialises a wgmma whose register inputs it cannot prove untouched while it runs (warning C7513: then
    every MMA waits for the one before, and all share one register set). A conditional block between two steps'
    MMAs was enough to trigger it; the copies are predicated instead. Too few registers are another trigger (its
    C7512: 64 tokens at three blocks an SM, 85 registers); two blocks an SM leave 128 a thread (64 accumulators at
    128 tokens, two A buffers of 16, the addressing), without local memory."""
    from lowering_helpers import lower_source, ptxas_report

    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm, shared_bytes

    blocks = 2
    assert blocks * (shared_bytes(block_t, k, 4) + 1024) <= 227 * 1024
    log, regs = ptxas_report(lower_source(build_fp4_expert_gemm(n, k, epilogue, block_t), "sm_90a"), tmp_path)
    assert "C7513" not in log and "Potential Performance Loss" not in log, log
    assert regs <= 65536 // (256 * blocks) and "0 bytes spill stores" in log, log


@needs_tilelang
def test_it_lowers_for_blackwell_through_mma_sync():
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm

    assert "xrs_mainloop<128,4>(" in lower_source(build_fp4_expert_gemm(4608, 5120, "swiglu"), "sm_100a")


def test_the_builder_refuses_shapes_that_do_not_tile():
    pytest.importorskip("tilelang")
    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm

    with pytest.raises(AssertionError):
        build_fp4_expert_gemm(4608 + 64, 5120, "swiglu")  # not whole 128-row blocks
    with pytest.raises(AssertionError):
        build_fp4_expert_gemm(4608, 5120 + 64, "swiglu")  # an odd number of 64-K steps
    with pytest.raises(AssertionError):
        build_fp4_expert_gemm(4608, 5120, "gelu")
    with pytest.raises(AssertionError):
        build_fp4_expert_gemm(4608, 5120, "swiglu", block_t=32)
