"""CPU checks of the prefill MoE's FP4 grouped GEMM (kernels/tilelang/expert_gemm_kernel.py), no GPU needed: at the
released widths it lowers to wgmma fed from shared memory on sm_90a, the FP4 tiles arrive by cp.async and are
dequantised in shared memory by di_dq_e2m1x8 (4 packed bytes in one load, 8 bf16 in one 16-byte store), and it
still lowers (mma.sync) for sm_100a and sm_80. The GPU test holds its numbers to moe_prefill.expert_gemm_torch."""

import importlib.util

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
