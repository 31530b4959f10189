"""The rope kernel (rowwise_kernel.build_rope) gives the same bits whether each thread takes four 16-byte chunks or
one (`rowwise.ROPE_ONE_CHUNK_BELOW`: decode's small launches spread over more blocks), in place and out of place:
its generated CUDA source run on the CPU under tests/cuda_emulation.py (the host's cosf / sinf on both sides)."""

import importlib.util

import pytest
import torch

from cuda_emulation import compile_kernel, gxx_ok

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed"),
    pytest.mark.skipif(not gxx_ok(), reason="needs g++ with C++20 <barrier>"),
]


@pytest.mark.parametrize("inplace", [False, True])
def test_one_chunk_a_thread_is_four_chunks_a_thread(inplace, tmp_path):
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang import rowwise_kernel as k
    from deepinfer.kernels.torch.rope import default_inv_freq

    dim, rd, heads, tokens = 128, 64, 3, 5
    runs = {per: compile_kernel(lower_source(k.build_rope(dim, rd, False, 128, per, inplace), "sm_90a"), tmp_path,
                                f"rope{per}")[0] for per in (1, 4)}
    g = torch.Generator().manual_seed(int(inplace))
    x = torch.randn(tokens * heads, dim, generator=g).bfloat16()
    pos = torch.randint(0, 1 << 17, (tokens,), generator=g)
    inv = default_inv_freq(10000.0, rd)
    chunks = tokens * heads * (rd if inplace else dim) // 8
    outs = {}
    for per, run in runs.items():
        src = x.clone()
        out = src if inplace else torch.full_like(x, float("nan"))
        run(-(-chunks // (128 * per)), x=src, pos=pos, inv_freq=inv, out=out, heads=heads, rows=tokens * heads,
            n_pos=tokens)
        outs[per] = out
    assert torch.isfinite(outs[1].float()).all() and torch.equal(outs[1], outs[4])
    assert not torch.equal(outs[1][:, -rd:], x[:, -rd:]) and torch.equal(outs[1][:, :-rd], x[:, :-rd])
