"""CPU checks of the FP4 expert dequant kernel (kernels/tilelang/expert_dequant_kernel.py), no GPU needed: it lowers
for the released widths on sm_90a and sm_100a with 8-byte loads and 16- or 32-byte stores, and a numpy model of its
integer selects gives every e2m1 code's value (the GPU test holds the kernel to the torch dequantisation)."""

import importlib.util

import numpy as np
import pytest
import torch

from deepinfer.kernels.torch import quant

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")


@needs_tilelang
@pytest.mark.parametrize("cols", [5120, 2304, 256])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_kernel_lowers_with_wide_loads_and_stores(cols, arch):
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.expert_dequant_kernel import build_fp4_rows_dequant

    src = lower_source(build_fp4_rows_dequant(cols), arch)
    assert "*(uint2*)(codes + 0)" in src  # the 8 packed bytes in one load
    # the 16 bf16 values in 16-byte stores (sm_90a) or one 32-byte store (sm_100a)
    assert "*(uint4*)(out + " in src or "store_global_256(&(*(ulonglong4*)(out + " in src


def test_the_integer_selects_give_every_e2m1_value():
    """Twice the magnitude by the kernel's selects, halved by the scale's extra 2^-1, signed by bit 3."""
    code = np.arange(16)
    mag = code & 7
    twice = np.where(mag < 4, mag, np.where(mag < 6, 2 * mag - 4, 4 * mag - 16))
    value = np.where(code >= 8, -twice, twice) * 0.5
    ref = quant.e2m1_values(torch.arange(16, dtype=torch.uint8)).numpy()
    assert np.array_equal(value, ref)
