"""CPU check of the SwiGLU over interleaved halves (kernels/tilelang/swiglu_kernel.py), no GPU needed: it lowers to
16-byte loads of a gate run and of its up run 32 columns on and one 16-byte store, with the accurate expf and an
IEEE division (the torch silu's own operations; no fast math). The GPU test holds it bitwise to the torch passes
(tests/gpu/test_prefill_paths.py); the CPU path is those passes."""

import importlib.util

import pytest
import torch

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")


@needs_tilelang
def test_it_lowers_with_wide_accesses_and_the_accurate_exp():
    from lowering_helpers import lower_source

    from deepinfer.kernels.tilelang.swiglu_kernel import build_swiglu_halves

    src = lower_source(build_swiglu_halves(2304), "sm_90a")
    assert "*(uint4*)(g + 0) = *(uint4*)(h + " in src and "*(uint4*)(u + 0) = *(uint4*)(h + " in src
    assert "(int64_t)32));" in src  # the up run: 32 columns after its gate run
    assert "*(uint4*)(y + " in src
    assert "expf(" in src and "__expf" not in src and "__fdividef" not in src


@needs_tilelang
def test_the_builder_takes_only_whole_halves():
    from deepinfer.kernels.tilelang.swiglu_kernel import build_swiglu_halves

    with pytest.raises(AssertionError):
        build_swiglu_halves(2304 + 16)


def test_the_torch_path_pairs_each_gate_column_with_the_up_column_32_on():
    from deepinfer.kernels.tilelang.shared_expert import swiglu_halves_torch

    h = torch.zeros(1, 128)
    h[0, 0], h[0, 32], h[0, 64 + 31], h[0, 64 + 63] = 2.0, 3.0, -1.0, 5.0  # gate 0 / up 0, gate 63 / up 63
    y = swiglu_halves_torch(h.bfloat16(), 0.0).float()[0]
    silu = torch.nn.functional.silu
    assert y.shape == (64,) and y[0] == (silu(torch.tensor(2.0)) * 3.0).bfloat16().float()
    assert y[63] == (silu(torch.tensor(-1.0)) * 5.0).bfloat16().float()
    assert (y[1:63] == 0).all()
    clamped = swiglu_halves_torch((h * 4).bfloat16(), 7.0).float()[0]  # gate 8 -> 7, up 12 -> 7
    assert clamped[0] == (silu(torch.tensor(7.0)) * 7.0).bfloat16().float()
