"""TileLang `compressor_pool`, `engram_hash` and `engram_gate` (kernels/tilelang/compressor.py, engram.py) against
the torch ops on CUDA and float64 references (marker gpu).

* compressor_pool: within a few fp32 ulps of the torch op and of float64 (odd ratios, odd row counts whose last
  group is incomplete, no complete group, large gates the max subtraction must keep finite, the Flash shape);
* engram_hash: bitwise the torch op's ids, on the Flash tables' value ranges and on arbitrary int64 (negative
  tokens, multipliers and primes; products that wrap);
* engram_gate: the torch op's outputs up to rare one-ulp bf16 differences (its sums run in another order), within a
  bf16 ulp of float64; a token's output is bitwise the same alone, in any batch and run to run, with and without the
  batch-invariant mode (the kernel serves both: no fallback).
All kernels are compiled up front in parallel (module fixture)."""

import numpy as np
import pytest
import torch

from deepinfer.kernels import registry
from deepinfer.kernels.torch import compressor as ref_compressor
from deepinfer.kernels.torch import engram as ref_engram

from ._helpers import poison_allocator

pytestmark = pytest.mark.gpu

FLASH_HC, FLASH_D, FLASH_HEAD = 4, 5120, 512  # V4.1-Flash: hc_mult, hidden_size, head_dim
FLASH_N, FLASH_L, FLASH_HEADS = 4, 2, 8        # Engram: max n-gram size, Engram layers, hash heads
POOL_CASES = [  # (rows, ratio, D)
    (2, 2, FLASH_HEAD), (8192 * 2, 2, FLASH_HEAD), (7, 2, FLASH_HEAD), (1, 2, FLASH_HEAD), (0, 2, FLASH_HEAD),
    (20, 4, FLASH_HEAD), (16, 5, 64), (33 * 16 + 3, 16, 128), (9, 1, 4), (300, 3, 1028)]
GATE_CASES = [  # (T, hc, D)
    (1, FLASH_HC, FLASH_D), (7, FLASH_HC, FLASH_D), (300, FLASH_HC, FLASH_D), (2048, FLASH_HC, FLASH_D),
    (5, FLASH_HC, 1024), (33, 2, 1028), (3, 1, 68), (4, 3, 4)]
HASH_CASES = [(1, FLASH_N, FLASH_L, FLASH_HEADS), (8193, FLASH_N, FLASH_L, FLASH_HEADS), (5, 2, 1, 1), (77, 3, 3, 5)]
_DT = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
GATE_DTYPES = [(torch.float32, torch.bfloat16, torch.float32),  # (key, value, weight): the model's
               (torch.bfloat16, torch.float32, torch.bfloat16)]
GATE_PARAMS = [(*case, GATE_DTYPES[0]) for case in GATE_CASES] + [(7, FLASH_HC, FLASH_D, GATE_DTYPES[1]),
                                                                 (33, 2, 1028, GATE_DTYPES[1])]


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    from deepinfer.kernels.tilelang._build import precompile
    from deepinfer.kernels.tilelang.compressor_kernel import build_compressor_pool
    from deepinfer.kernels.tilelang.engram_kernel import build_engram_gate, build_engram_hash

    specs = [(build_compressor_pool, r, d) for _, r, d in POOL_CASES]
    specs += [(build_engram_hash, n, lay, h) for _, n, lay, h in HASH_CASES]
    specs += [(build_engram_gate, hc, d, _DT[k], _DT[v], _DT[w]) for _, hc, d, (k, v, w) in GATE_PARAMS]
    precompile(specs)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _fallbacks(kind: str) -> int:
    return sum(registry.fallback_counts().get(kind, {}).values())


# ---------------------------------------------------------------------------------------------- compressor_pool
def _pool64(kv, gate, ratio):
    g = kv.shape[0] // ratio
    kv, gate = kv[: g * ratio].double().view(g, ratio, -1), gate[: g * ratio].double().view(g, ratio, -1)
    p = gate.softmax(dim=1)
    return (kv * p).sum(1), (kv.abs() * p).sum(1)  # the value and the scale of its rounding error


@pytest.mark.parametrize("rows,ratio,dim", POOL_CASES)
def test_compressor_pool_matches_torch_and_float64(rows, ratio, dim):
    from deepinfer.kernels.tilelang.compressor import compressor_pool

    g = _gen(rows * 31 + ratio * 7 + dim)
    kv = torch.randn(rows, dim, generator=g, device="cuda") * 3
    gate = torch.randn(rows, dim, generator=g, device="cuda") * 4
    if rows >= 4:
        gate[1::4] *= 50  # gates up to ~800: exp overflows without the max subtraction
    before = _fallbacks("compressor_pool")
    poison_allocator()
    out = compressor_pool(kv, gate, ratio)
    torch.cuda.synchronize()
    assert _fallbacks("compressor_pool") == before
    ref = ref_compressor.compressor_pool(kv, gate, ratio)
    assert out.shape == ref.shape == (rows // ratio, dim) and out.dtype == torch.float32
    if out.numel() == 0:
        return
    exact, scale = _pool64(kv, gate, ratio)
    tol = 4e-6 * scale + 1e-30
    assert torch.isfinite(out).all()
    assert ((out.double() - exact).abs() <= tol).all(), (out.double() - exact).abs().div(scale).max().item()
    assert ((ref.double() - exact).abs() <= tol).all()  # the bound holds for the torch op too
    assert ((out.double() - ref.double()).abs() <= tol).all()
    print(f"rows {rows} ratio {ratio} D {dim}: {(out == ref).float().mean().item() * 100:.2f}% bitwise the torch op")


def test_compressor_pool_groups_do_not_depend_on_the_batch():
    from deepinfer.kernels.tilelang.compressor import compressor_pool

    g = _gen(3)
    kv, gate = (torch.randn(2 * 300, FLASH_HEAD, generator=g, device="cuda") for _ in range(2))
    full = compressor_pool(kv, gate, 2)
    assert torch.equal(full, compressor_pool(kv, gate, 2))
    for lo, hi in ((0, 1), (17, 18), (40, 299)):
        assert torch.equal(compressor_pool(kv[2 * lo: 2 * hi], gate[2 * lo: 2 * hi], 2), full[lo:hi]), (lo, hi)


def test_compressor_pool_uncovered_inputs_take_the_torch_op_and_are_counted():
    from deepinfer.kernels.tilelang.compressor import compressor_pool

    g = _gen(4)
    kv, gate = (torch.randn(34, 6, generator=g, device="cuda") for _ in range(2))  # width 6: not a multiple of 4
    before = _fallbacks("compressor_pool")
    assert torch.equal(compressor_pool(kv, gate, 2), ref_compressor.compressor_pool(kv, gate, 2))
    kv, gate = (torch.randn(34, 8, generator=g, device="cuda") for _ in range(2))
    assert torch.equal(compressor_pool(kv, gate, 17), ref_compressor.compressor_pool(kv, gate, 17))  # ratio > 16
    assert _fallbacks("compressor_pool") == before + 2


# ---------------------------------------------------------------------------------------------- engram_hash
def _flash_tables(n, layers, heads, gen):
    """Tables in the ranges the model's have (models/engram.py): odd multipliers below int64 max / vocab, primes
    above the Engram vocabulary, offsets their running sums."""
    vocab = 99092
    bound = (np.iinfo(np.int64).max // vocab) // 2
    mult = torch.randint(0, bound, (layers, n), generator=gen, device="cuda") * 2 + 1
    primes = torch.randint(16_000_000, 16_100_000, (layers, n - 1, heads), generator=gen, device="cuda")
    offsets = torch.cumsum(primes.view(layers, -1), -1) - primes.view(layers, -1)
    return vocab, mult, primes, offsets


def _any_int64(shape, gen):
    hi = torch.randint(-2**31, 2**31, shape, generator=gen, device="cuda")
    lo = torch.randint(0, 2**32, shape, generator=gen, device="cuda")
    return hi * 2**32 + lo  # every int64 bit pattern possible (the multiply wraps on purpose)


@pytest.mark.parametrize("T,n,layers,heads", HASH_CASES)
def test_engram_hash_is_bitwise_the_torch_op(T, n, layers, heads):
    from deepinfer.kernels.tilelang.engram import engram_hash

    g = _gen(T * 13 + n)
    vocab, mult, primes, offsets = _flash_tables(n, layers, heads, g)
    tokens = torch.randint(0, vocab, (T, n), generator=g, device="cuda")
    cases = [(tokens, mult, primes, offsets)]
    # arbitrary int64: negative tokens and multipliers, wrapping products, primes of both signs (|p| >= 2)
    p = torch.randint(2, 2**40, (layers, n - 1, heads), generator=g, device="cuda")
    sign = torch.where(torch.rand(p.shape, generator=g, device="cuda") < 0.5, -1, 1)
    cases.append((_any_int64((T, n), g), _any_int64((layers, n), g), p * sign,
                  torch.randint(-2**40, 2**40, (layers, (n - 1) * heads), generator=g, device="cuda")))
    before = _fallbacks("engram_hash")
    for args in cases:
        poison_allocator()
        out = engram_hash(*args)
        torch.cuda.synchronize()
        ref = ref_engram.engram_hash(*args)
        assert out.dtype == ref.dtype == torch.int64 and out.shape == ref.shape == (T, layers, (n - 1) * heads)
        assert torch.equal(out, ref), (out != ref).sum().item()
        assert torch.equal(out.cpu(), ref_engram.engram_hash(*(a.cpu() for a in args)))  # CPU torch: same ids
    assert (cases[0][0] >= 0).all() and (engram_hash(*cases[0]) >= 0).all()
    assert _fallbacks("engram_hash") == before


def test_engram_hash_of_no_token_is_empty_without_a_fallback():
    from deepinfer.kernels.tilelang.engram import engram_hash

    _, mult, primes, offsets = _flash_tables(FLASH_N, FLASH_L, FLASH_HEADS, _gen(5))
    tokens = torch.zeros(0, FLASH_N, dtype=torch.int64, device="cuda")
    before = _fallbacks("engram_hash")
    out = engram_hash(tokens, mult, primes, offsets)
    assert out.shape == ref_engram.engram_hash(tokens, mult, primes, offsets).shape == (0, FLASH_L, 24)
    assert _fallbacks("engram_hash") == before


# ---------------------------------------------------------------------------------------------- engram_gate
def _gate_inputs(T, hc, dim, seed, dtypes=GATE_DTYPES[0]):
    kd, vd, wd = dtypes
    g = _gen(seed)
    scale = torch.exp2(torch.randint(-3, 4, (T, hc, 1), generator=g, device="cuda").float())
    streams = (torch.randn(T, hc, dim, generator=g, device="cuda") * scale).bfloat16()
    key = (torch.randn(T, hc, dim, generator=g, device="cuda") * 2).to(kd)
    value = torch.randn(T, dim, generator=g, device="cuda").to(vd)
    weight = (torch.randn(hc, dim, generator=g, device="cuda") * 0.5 + 1).to(wd)
    if T > 2:
        streams[1, 0] = 0  # a zero stream: eps decides its rstd, its dot is 0 (gate sigmoid(+1e-3))
        key[2, -1] = -streams[2, -1].to(kd)  # a large negative dot
    return streams, key, value, weight


def _gate64(streams, key, value, weight, eps):
    """(float64 output, |dot|): the torch op's formula in float64 on the same (rounded) inputs."""
    h, k = streams.double(), key.double()
    d = h.shape[-1]
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * weight.double() * k).sum(-1) * rstd * d ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return h + gate.unsqueeze(-1) * value.double().unsqueeze(-2), dot.abs()


def _gate_tolerance(streams, value, dot_abs):
    """One bf16 ulp of the float64 result, plus the gate's fp32 error times |value|: 1e-5 where |dot| >= 1e-2, 2e-3
    near 0 (the signed square root's slope: sums in another fp32 order move the gate by up to ~4e-4 there)."""
    gate_err = torch.where(dot_abs >= 1e-2, 1e-5, 2e-3).unsqueeze(-1)
    return gate_err * value.double().abs().unsqueeze(-2) + 1e-6 * streams.double().abs()


@pytest.mark.parametrize("T,hc,dim,dtypes", GATE_PARAMS)
@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_engram_gate_matches_float64_and_the_torch_op(T, hc, dim, dtypes, eps):
    from deepinfer.kernels.tilelang.engram import engram_gate

    args = _gate_inputs(T, hc, dim, T * 7 + hc * 3 + dim, dtypes)
    before = _fallbacks("engram_gate")
    poison_allocator()
    out = engram_gate(*args, eps)
    torch.cuda.synchronize()
    assert _fallbacks("engram_gate") == before
    ref = ref_engram.engram_gate(*args, eps)
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.bfloat16
    exact, dot_abs = _gate64(*args, eps)
    tol = _gate_tolerance(args[0], args[2], dot_abs)
    err = (out.double() - exact).abs()
    ulp = 2.0 ** -8 * exact.abs()  # bf16: 8 significant bits; one ulp <= 2^-7 |x|, half an ulp of rounding
    assert (err <= 2 * ulp + tol).all(), (err - 2 * ulp - tol).max().item()
    assert ((ref.double() - exact).abs() <= 2 * ulp + tol).all()  # the torch op meets the same bound
    same = (out.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
    print(f"T {T} hc {hc} D {dim} {dtypes}: {same * 100:.3f}% bitwise the torch op")
    strict = (dot_abs >= 1e-2).unsqueeze(-1).expand_as(out)
    diff = out.view(torch.int16) != ref.view(torch.int16)
    assert (diff & strict).float().mean().item() <= 1e-3


def test_engram_gate_rows_are_bitwise_equal_alone_in_any_batch_and_mode():
    from deepinfer.kernels.tilelang.engram import engram_gate

    streams, key, value, weight = _gate_inputs(300, FLASH_HC, FLASH_D, 11)
    # value as the model passes it (a column slice of the fused K/V projection), and a contiguous but misaligned copy
    wide = torch.zeros(300, FLASH_D + 8, dtype=torch.bfloat16, device="cuda")
    wide[:, 8:] = value
    flat = torch.zeros(300 * FLASH_D + 1, dtype=torch.bfloat16, device="cuda")
    flat[1:] = value.flatten()
    views = (wide[:, 8:], flat[1:].view(300, FLASH_D))
    assert not views[0].is_contiguous() and views[1].data_ptr() % 16
    before = _fallbacks("engram_gate")
    full = engram_gate(streams, key, value, weight, 1e-20)
    assert torch.equal(full, engram_gate(streams, key, value, weight, 1e-20))  # run to run
    for view in views:
        assert torch.equal(full, engram_gate(streams, key, view, weight, 1e-20))
    try:
        registry.OpSet.build("cuda", ["torch"], batch_invariant=True)
        assert registry.batch_invariant()
        for lo, hi in ((0, 1), (5, 6), (299, 300), (0, 7), (64, 129), (1, 300)):
            got = engram_gate(streams[lo:hi], key[lo:hi], value[lo:hi], weight, 1e-20)
            assert torch.equal(got, full[lo:hi]), (lo, hi)
    finally:
        registry.OpSet.build("cuda", ["torch"], batch_invariant=False)
    for lo, hi in ((0, 1), (150, 151), (3, 200)):
        assert torch.equal(engram_gate(streams[lo:hi], key[lo:hi], value[lo:hi], weight, 1e-20), full[lo:hi])
    assert _fallbacks("engram_gate") == before


def test_engram_gate_edge_inputs():
    from deepinfer.kernels.tilelang.engram import engram_gate

    streams, key, value, weight = _gate_inputs(3, FLASH_HC, FLASH_D, 12)
    before = _fallbacks("engram_gate")
    empty = engram_gate(streams[:0], key[:0], value[:0], weight, 1e-6)
    assert empty.shape == (0, FLASH_HC, FLASH_D) and empty.dtype == torch.bfloat16
    assert _fallbacks("engram_gate") == before
    # fp32 streams are not a kernel input: the torch op, counted
    out = engram_gate(streams.float(), key, value, weight, 1e-6)
    assert torch.equal(out, ref_engram.engram_gate(streams.float(), key, value, weight, 1e-6))
    assert _fallbacks("engram_gate") == before + 1
