"""CPU check of the prefill MoE's combine kernel (kernels/tilelang/moe_combine_kernel.py), no GPU needed: it lowers
with 16-byte loads of each expert row and of the shared expert's row and one 16-byte store, summing in the order
given. The GPU test holds it bitwise to the torch sum (tests/gpu/test_prefill_paths.py); the CPU path is that sum."""

import importlib.util

import pytest
import torch

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")


@needs_tilelang
def test_it_lowers_with_wide_accesses():
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.moe_combine_kernel import build_moe_combine

    src = lower_source(build_moe_combine(5120, 6), "sm_90a")
    assert "condval = *(uint4*)(out + " in src  # an expert row, 8 bf16 at once
    assert "*(uint4*)(buf + 0) = *(uint4*)(shared + " in src
    assert "*(uint4*)(y + " in src


def test_the_torch_path_sums_in_the_order_given_then_adds_the_shared_expert():
    from deepinfer.kernels.tilelang.moe_prefill import combine

    out = torch.tensor([[256.0], [-256.0], [1.0]]).bfloat16()  # rows 0, 1, 2
    shared = torch.zeros(1, 1, dtype=torch.bfloat16)
    assert combine(out, torch.tensor([[0, 1, 2]]), shared).item() == 1.0
    assert combine(out, torch.tensor([[2, 0, 1]]), shared + 3).item() == 4.0
