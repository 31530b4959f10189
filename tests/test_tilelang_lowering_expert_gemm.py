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


@needs_tilelang
@pytest.mark.parametrize("n,k,epilogue", SHAPES)
def test_the_warp_specialised_candidate_dequantises_beside_the_mmas(n, k, epilogue):
    """build_fp4_expert_gemm_ws (moe_prefill.WARP_SPECIALISED): a producer warpgroup (112 registers) dequantises
    each 64-K step into one half of a double weight buffer between mbarrier waits, from two register sets in turn
    (one copy of the dequantisation each), while two math warpgroups (192) each multiply their own 64-row tile by it
    (m64n256k16 from shared memory), waiting on the half of the step's index; no CTA-wide barrier after the
    barriers' initialisation; ptxas fits it without a spill where nvcc is installed."""
    import shutil
    import tempfile
    from pathlib import Path

    from lowering_helpers import lower_source, ptxas_report

    from deepinfer.kernels.tilelang.expert_gemm_kernel import build_fp4_expert_gemm_ws

    src = lower_source(build_fp4_expert_gemm_ws(n, k, epilogue), "sm_90a")
    assert "warpgroup_reg_alloc<192>" in src and "warpgroup_reg_dealloc<112>" in src
    assert src.count("64, 256, 16, false, false") == 2  # one wgmma shape per math warpgroup's loop
    assert src.count("di_dq_e2m1x8((") == 2 and src.count("__syncthreads()") == 1
    assert "full[(kk & 1)].wait(" in src and "empty[0].wait(" in src and "empty[1].wait(" in src
    if shutil.which("nvcc"):
        with tempfile.TemporaryDirectory() as tmp:
            log, regs = ptxas_report(src, Path(tmp))
        assert regs <= 168 and "0 bytes spill stores" in log
