"""The GEMV mixes (kernels/tilelang/mhc_gemv_kernel.py, `mhc.GEMV_TOKENS`) computes the mHC mixes: its
generated CUDA source runs on the CPU under tests/cuda_emulation.py (blocks in turn, so the last block to count in
finalizes), against a float64 reference of the torch op's formulas, at a small width (hc 4 x D 128, four blocks of
128 columns). The device's own expf / reciprocal are the host's here; tests/gpu/test_tilelang_mhc.py holds the same
band on the GPU at the released width."""

import importlib.util

import pytest
import torch

from cuda_emulation import compile_kernel, gxx_ok
from gpu._helpers import mhc_mixes64

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed"),
    pytest.mark.skipif(not gxx_ok(), reason="needs g++ with C++20 <barrier>"),
]

HC, D, SPLITS, MAX_TOKENS, ITERS, HC_EPS, NORM_EPS = 4, 128, 4, 8, 20, 1e-6, 1e-6
N = (2 + HC) * HC

# host versions of the helpers the kernel's imported device source defines (mhc_kernel.RCP_SOURCE, counters')
PRELUDE = r"""
#include <atomic>
inline float di_rcp_nr(float x) { float r = 1.0f / x; return std::fma(r, std::fma(-x, r, 1.0f), r); }
inline float di_ld_cg(const float* p) { return *(const volatile float*)p; }
template <class T, class U> inline T AtomicAddRet(T* p, U v) { return __atomic_fetch_add(p, (T)v, __ATOMIC_SEQ_CST); }
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from lowering_helpers import lower_source
    from deepinfer.kernels.tilelang.mhc_gemv_kernel import build_mhc_mixes_gemv

    src = lower_source(build_mhc_mixes_gemv(HC, D, SPLITS, MAX_TOKENS, ITERS, 4), "sm_90a")
    return compile_kernel(src, tmp_path_factory.mktemp("mhc_gemv"), prelude=PRELUDE)[0]


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_the_gemv_mixes_are_the_mixes_in_fp32(kernel, tokens):
    g = torch.Generator().manual_seed(tokens)
    s = 10 ** (torch.rand(tokens, 1, generator=g) * 2 - 1)  # a token's RMS its own, over two decades
    x = (torch.randn(tokens, HC * D, generator=g) * s).bfloat16()
    fn = torch.randn(N, HC * D, generator=g) * 0.1
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(N, generator=g) * 0.5
    part = torch.full((SPLITS, tokens, 32), float("nan"))
    pre, post = torch.full((tokens, HC), float("nan")), torch.full((tokens, HC), float("nan"))
    comb = torch.full((tokens, HC, HC), float("nan"))
    cnt = torch.zeros(4, dtype=torch.int32)
    for _ in range(2):  # the counter back at zero: a second launch finalizes too
        kernel(SPLITS, x=x, fn=fn, part=part, scale=scale, base=base, pre=pre, post=post, comb=comb, cnt=cnt,
               hc_eps=HC_EPS, norm_eps=NORM_EPS, n_tok=tokens)
        assert not cnt.any()
    # the partials: block b's dots over its 128 columns and the sum of squares, in fp32
    xs = x.double().view(tokens, SPLITS, 128)
    fs = fn.double().view(N, SPLITS, 128)
    want = torch.cat([torch.einsum("tbk,nbk->btn", xs, fs), xs.square().sum(-1).T[..., None]], -1)
    assert torch.allclose(part[..., :N + 1].double(), want, rtol=1e-5, atol=1e-5)
    expect = mhc_mixes64(x.view(tokens, HC, D), fn, scale, base, HC_EPS, ITERS, NORM_EPS)
    for name, got, ref in zip(("pre", "post", "comb"), (pre, post, comb), expect):
        assert torch.isfinite(got).all(), name
        per_tok = ((got.double() - ref).reshape(tokens, -1).norm(dim=1) / ref.reshape(tokens, -1).norm(dim=1))
        assert per_tok.max().item() < 1e-5, (name, per_tok)
