"""CPU checks of the compressor pooling and Engram TileLang kernels (compressor_kernel.py, engram_kernel.py and their
launchers), no GPU needed:
* every builder the launchers pick for V4.1-Flash's shapes (and odd ones) lowers to CUDA source for sm_90a and
  sm_100a, with the roundings the kernels rely on visible in the source (accurate expf, `__fmul_rn`, rsqrtf, the
  uint64 wrapping products, C's `%` plus the sign fix-up);
* a numpy model of the hash kernel's arithmetic, written op for op like it, gives the torch op's ids bit for bit on
  arbitrary int64 (negative values, wrapping products, primes of both signs);
* the launchers keep the torch ops' signatures and hand CPU inputs to them; the torch pooling op maps no complete
  group to [0, D].
"""

import importlib.util
import inspect

import numpy as np
import pytest
import torch

from deepinfer.kernels.torch import compressor as torch_compressor
from deepinfer.kernels.torch import engram as torch_engram

needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")


def _kernels():
    from deepinfer.kernels.tilelang import compressor_kernel as ck
    from deepinfer.kernels.tilelang import engram_kernel as ek

    return {
        "pool_r2_512": lambda: ck.build_compressor_pool(2, 512),      # V4.1-Flash: pairs of head_dim 512
        "pool_r5_68": lambda: ck.build_compressor_pool(5, 68),        # odd ratio, a width that leaves no full warp
        "pool_r16_128": lambda: ck.build_compressor_pool(16, 128),    # ATen's four accumulators all in use
        "hash_flash": lambda: ek.build_engram_hash(4, 2, 8),          # n-grams of 2..4, 2 Engram layers, 8 heads
        "hash_n2": lambda: ek.build_engram_hash(2, 1, 1),
        "gate_flash": lambda: ek.build_engram_gate(4, 5120),          # hc 4, hidden 5120: 5 vectors per thread
        "gate_1028": lambda: ek.build_engram_gate(2, 1028, "bfloat16", "float32", "bfloat16"),  # a ragged tail
    }


NAMES = ["pool_r2_512", "pool_r5_68", "pool_r16_128", "hash_flash", "hash_n2", "gate_flash", "gate_1028"]


@needs_tilelang
def test_names_cover_builders():
    assert set(NAMES) == set(_kernels())


@needs_tilelang
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", NAMES)
def test_kernel_lowers_to_cuda(name, arch):
    from lowering_helpers import lower_source

    src = lower_source(_kernels()[name](), arch)
    assert "__global__" in src
    assert "__expf" not in src and "__fdividef" not in src  # no fast-math intrinsics
    if name.startswith("pool"):
        assert "expf(" in src and "__fmul_rn" in src and "*(float4*)" in src
    if name.startswith("hash"):
        assert "(uint64_t)" in src and " % " in src
    if name.startswith("gate"):
        assert "rsqrtf(" in src and "sqrtf(" in src and "copysignf(" in src and "expf(" in src
        assert "__shfl_xor_sync" in src and "__syncthreads" in src and "__fmul_rn" in src


def model_engram_hash(tokens, multipliers, primes, offsets) -> np.ndarray:
    """engram_kernel.build_engram_hash, op for op: uint64 products (wrapping), int64 xor, C's truncating remainder
    (np.fmod) plus the divisor where the signs differ, a wrapping add of the offset."""
    t, m = tokens.numpy().astype(np.uint64), multipliers.numpy().astype(np.uint64)
    p_all, off = primes.numpy(), offsets.numpy().astype(np.uint64)
    n, (layers, _, heads) = t.shape[1], p_all.shape
    out = np.zeros((t.shape[0], layers, (n - 1) * heads), dtype=np.int64)
    with np.errstate(over="ignore"):
        for lay in range(layers):
            roll = (t[:, 0] * m[lay, 0]).view(np.int64)
            for i in range(1, n):
                roll = roll ^ (t[:, i] * m[lay, i]).view(np.int64)
                p = p_all[lay, i - 1][None, :]
                r = np.fmod(roll[:, None], p)
                r = r + np.where((r != 0) & ((r < 0) != (p < 0)), p, 0)
                cols = slice((i - 1) * heads, i * heads)
                out[:, lay, cols] = (r.astype(np.uint64) + off[lay, cols]).view(np.int64)
    return out


@pytest.mark.parametrize("n,layers,heads", [(4, 2, 8), (2, 1, 1), (3, 3, 5)])
def test_hash_model_is_bitwise_the_torch_op_on_any_int64(n, layers, heads):
    g = torch.Generator().manual_seed(n * 100 + heads)

    def any_int64(*shape):
        return torch.randint(-2**31, 2**31, shape, generator=g) * 2**32 + torch.randint(0, 2**32, shape, generator=g)

    primes = torch.randint(2, 2**40, (layers, n - 1, heads), generator=g)
    primes = torch.where(torch.rand(primes.shape, generator=g) < 0.5, -primes, primes)
    offsets = torch.randint(-2**62, 2**62, (layers, (n - 1) * heads), generator=g)
    for tokens, mult in ((any_int64(300, n), any_int64(layers, n)),
                         (torch.randint(0, 99092, (300, n), generator=g), torch.randint(0, 2**46, (layers, n),
                                                                                        generator=g) * 2 + 1)):
        ref = torch_engram.engram_hash(tokens, mult, primes, offsets)
        assert np.array_equal(model_engram_hash(tokens, mult, primes, offsets), ref.numpy())


@needs_tilelang
def test_launchers_keep_the_torch_signatures():
    from deepinfer.kernels.tilelang import compressor, engram

    for ours, ref in ((compressor.compressor_pool, torch_compressor.compressor_pool),
                      (engram.engram_hash, torch_engram.engram_hash), (engram.engram_gate, torch_engram.engram_gate)):
        assert inspect.signature(ours) == inspect.signature(ref), ours.__name__


@needs_tilelang
def test_cpu_inputs_take_the_torch_op():
    from deepinfer.kernels.tilelang import compressor, engram

    g = torch.Generator().manual_seed(0)
    kv, gate = torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g)
    assert torch.equal(compressor.compressor_pool(kv, gate, 2), torch_compressor.compressor_pool(kv, gate, 2))
    tokens = torch.randint(0, 500, (5, 4), generator=g)
    mult, primes = torch.randint(1, 2**40, (2, 4), generator=g), torch.randint(100, 200, (2, 3, 8), generator=g)
    offsets = torch.randint(0, 1000, (2, 24), generator=g)
    assert torch.equal(engram.engram_hash(tokens, mult, primes, offsets),
                       torch_engram.engram_hash(tokens, mult, primes, offsets))
    streams, key = torch.randn(3, 4, 64, generator=g).bfloat16(), torch.randn(3, 4, 64, generator=g)
    value, weight = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(4, 64, generator=g)
    assert torch.equal(engram.engram_gate(streams, key, value, weight, 1e-6),
                       torch_engram.engram_gate(streams, key, value, weight, 1e-6))


def test_torch_pool_of_no_complete_group_is_empty():
    for rows in (0, 1):
        out = torch_compressor.compressor_pool(torch.randn(rows, 8), torch.randn(rows, 8), 2)
        assert out.shape == (0, 8) and out.dtype == torch.float32
