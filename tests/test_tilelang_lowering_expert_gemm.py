"""CPU checks of the prefill MoE's FP4 grouped GEMM (kernels/tilelang/expert_gemm_kernel.py), no GPU needed: at the
released widths it lowers to wgmma fed from shared memory on sm_90a, the FP4 tiles arrive by cp.async and are
dequantised in shared memory by di_dq_e2m1x8 (4 packed bytes in one load, 8 bf16 in one 16-byte store), and it
still lowers (mma.sync) for sm_100a and sm_80. The GPU test holds its numbers to moe_prefill.expert_gemm_torch."""

import importlib.util
import shutil

import pytest

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")

SHAPES = [(4608, 5120, "swiglu"), (5120, 2304, "plain")]  # V4.1-Flash's gate/up and down projections


@needs_tilelang
@pytest.mark.parametrize("n,k,epilogue", SHAPES)
def test_hopper_lowering_streams_fp4_and_multiplies_from_shared_memory(n, k, epilogue):
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm

    src = lower_source(build_fp4_expert_gemm(n, k, epilogue), "sm_90a")
    assert "tl::wgmma_ss<" in src
    assert "cp_async_gs_conditional<16>((&(((uchar*)q_s)" in src  # packed weights, 16 bytes per copy
    assert "*(uint*)(packed + 0) = *(uint*)(((uchar*)q_s)" in src
    assert "di_dq_e2m1x8(" in src and "= *(uint4*)(vals + 0);" in src


@needs_tilelang
@pytest.mark.parametrize("arch", ["sm_100a", "sm_80"])
def test_it_lowers_for_other_architectures(arch):
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm

    assert "di_dq_e2m1x8(" in lower_source(build_fp4_expert_gemm(4608, 5120, "swiglu"), arch)


def test_the_builder_refuses_shapes_that_do_not_tile():
    pytest.importorskip("tilelang")
    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm

    with pytest.raises(AssertionError):
        build_fp4_expert_gemm(4608 + 64, 5120, "swiglu")
    with pytest.raises(AssertionError):
        build_fp4_expert_gemm(4608, 5120, "gelu")


RS_SHAPES = [(4608, 5120, "swiglu", 128), (5120, 2304, "plain", 128), (4608, 5120, "swiglu", 64)]


@needs_tilelang
@pytest.mark.parametrize("n,k,epilogue,block_t", RS_SHAPES)
def test_the_register_variant_dequantises_into_wgmma_fragments_with_the_tokens_on_n(n, k, epilogue, block_t):
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.expert_gemm_rs_kernel import build_fp4_expert_gemm_rs

    src = lower_source(build_fp4_expert_gemm_rs(n, k, epilogue, block_t=block_t), "sm_90a")
    assert f"wgmma.mma_async.sync.aligned.m64n{block_t}k16.f32.bf16.bf16" in src  # A from registers, tokens on N
    assert f"xrs_mainloop<{block_t},4>(" in src and "di3_e2m1x8(p0.x, s0, d0);" in src
    assert "wgmma_ss" not in src and "w_s" not in src  # no dequantised weight tile in shared memory


@needs_tilelang
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("n,k,epilogue,block_t", RS_SHAPES[:2])
def test_the_register_variant_fits_two_blocks_an_sm_without_spilling(n, k, epilogue, block_t, tmp_path):
    """Two blocks of 256 threads an SM (its launch bounds) leave 128 registers a thread: the 64 accumulators, two
    A buffers of 16 and the addressing must fit without local memory."""
    from lowering_helpers import lower_source, ptxas_report

    from deepinfer.kernels.tilelang.expert_gemm_rs_kernel import build_fp4_expert_gemm_rs, shared_bytes

    assert 2 * shared_bytes(block_t, k, 4) <= 227 * 1024
    log, regs = ptxas_report(lower_source(build_fp4_expert_gemm_rs(n, k, epilogue, block_t, min_blocks=2),
                                          "sm_90a"), tmp_path)
    assert regs <= 128 and "0 bytes spill stores" in log, log


@needs_tilelang
def test_the_register_variant_lowers_for_blackwell_through_mma_sync():
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.expert_gemm_rs_kernel import build_fp4_expert_gemm_rs

    assert "xrs_mainloop<128,4>(" in lower_source(build_fp4_expert_gemm_rs(4608, 5120, "swiglu"), "sm_100a")
