"""CPU check of the TileLang mHC kernels: every builder (each K-split variant the wrapper can pick) lowers to CUDA
source for sm_90a and sm_100a without a GPU."""

import importlib.util

import pytest
import torch

tilelang_missing = importlib.util.find_spec("tilelang") is None

HC, D, ITERS = 4, 5120, 20


def _kernels():
    from deepinfer.kernels.tilelang import mhc as wrap
    from deepinfer.kernels.tilelang import mhc_kernel as k

    steps = HC * D // wrap.BLOCK_K
    out = {f"premix_s{s}": (lambda s=s: k.build_mhc_premix(HC, D, s, wrap.BLOCK_T, wrap.BLOCK_K,
                                                            wrap._stages(s, steps)))
           for s in wrap.SPLITS}
    out.update({f"finalize_s{s}": (lambda s=s: k.build_mhc_mix_finalize(HC, D, s, ITERS)) for s in wrap.SPLITS})
    out["finalize_iters1"] = lambda: k.build_mhc_mix_finalize(HC, D, 4, 1)
    out.update({f"mixes_fused_s{s}": (lambda s=s: k.build_mhc_premix(HC, D, s, wrap.BLOCK_T, wrap.BLOCK_K,
                                                                      wrap._stages(s, steps), 128, ITERS,
                                                                      wrap.TILE_COUNTERS))
                for s in (1, 64)})
    from deepinfer.kernels.tilelang.mhc_gemv_kernel import build_mhc_mixes_gemv

    out["mixes_gemv"] = lambda: build_mhc_mixes_gemv(HC, D, wrap.GEMV_SPLITS, 8, ITERS, wrap.TILE_COUNTERS)
    out["mixes_gemv_early"] = lambda: build_mhc_mixes_gemv(HC, D, wrap.GEMV_SPLITS, 8, ITERS, wrap.TILE_COUNTERS,
                                                           1, True)
    out["collapse"] = lambda: k.build_mhc_collapse(HC, D)
    out["expand"] = lambda: k.build_mhc_expand(HC, D)
    out["collapse_512"] = lambda: k.build_mhc_collapse(HC, 1536, 512, 64)
    out["expand_256"] = lambda: k.build_mhc_expand(HC, 768, 256, 32)
    from deepinfer.kernels.tilelang.collapse_norm_kernel import build_mhc_collapse_norm

    out["collapse_norm"] = lambda: build_mhc_collapse_norm(HC, D)
    out["collapse_norm_fp32w"] = lambda: build_mhc_collapse_norm(HC, D, "fp32")
    return out


NAMES = ["premix_s1", "premix_s4", "premix_s16", "premix_s64", "finalize_s1", "finalize_s4", "finalize_s16",
         "finalize_s64", "finalize_iters1", "mixes_fused_s1", "mixes_fused_s64", "mixes_gemv", "mixes_gemv_early",
         "collapse", "expand",
         "collapse_512", "expand_256", "collapse_norm", "collapse_norm_fp32w"]


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_names_cover_every_split():
    from deepinfer.kernels.tilelang import mhc as wrap

    assert {f"premix_s{s}" for s in wrap.SPLITS} <= set(NAMES)


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("name", NAMES)
def test_mhc_kernel_lowers_to_cuda(name, arch):
    from lowering_helpers import lower_source

    src = lower_source(_kernels()[name](), arch)
    assert "__global__" in src
    if name.startswith(("premix", "mixes_fused")) and arch == "sm_90a":
        assert "wgmma" in src  # the projection must take the Hopper tensor-core path (one n=80 instruction)
        assert ", 64, 80, 16," in src
    if name.startswith(("collapse", "expand")):
        assert "*(uint4*)" in src  # 16-byte vector loads / stores
    if name.startswith("collapse_norm"):  # the collapsed row in shared memory, then the norm's rounded squares
        assert "__syncthreads" in src and "__fmul_rn" in src and "rsqrtf(" in src


def test_collapse_norm_collapses_with_the_collapse_kernels_expression():
    """The fused kernel's per-channel collapse is the collapse kernel's CUDA expression, character for character
    (both then contract p * x into the same fma chain), so its bf16 row is the collapse kernel's."""
    pytest.importorskip("tilelang")
    from lowering_helpers import lower_source

    def body(src):  # the collapse's fp32 arithmetic lines, loop variable names normalised
        import re

        lines = [ln.strip() for ln in src.splitlines() if ln.strip().startswith("a[")]
        return [re.sub(r"\b(v|i)(_\d+)?\b", "i", ln) for ln in lines]

    ks = _kernels()
    fused, plain = body(lower_source(ks["collapse_norm"](), "sm_90a")), body(lower_source(ks["collapse"](), "sm_90a"))
    assert fused == plain and len(plain) == 2, (fused, plain)


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_split_choice():
    from deepinfer.kernels.tilelang.mhc import _splits

    steps = HC * D // 64
    assert _splits(1, steps) == 64 and _splits(256, steps) == 64  # decode: 64..256 blocks
    assert _splits(4096, steps) == 4 and _splits(32768, steps) == 1
    assert all(steps % _splits(t, steps) == 0 for t in (1, 7, 64, 300, 1000, 4096, 8192, 32768))


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_fused_mixes_finalize_a_tile_in_its_last_block_with_the_finalize_kernels_sums():
    """One launch: every split block fences its partials and counts in; the last sums the tile's partials in split
    order past L1 (as mhc_mix_finalize sums them), finalizes the tile's tokens and zeroes its counter."""
    from lowering_helpers import lower_source

    body = lower_source(_kernels()["mixes_fused_s64"](), "sm_90a")
    body = body[body.index("__global__"):]
    fence, arrive = body.index("__threadfence();"), body.index("AtomicAddRet(")
    assert fence < body.index("__syncthreads();", fence) < arrive
    tail = body[arrive:]
    assert "== 63)" in tail and "for (int s = 0; s < 64; ++s)" in tail and "di_ld_cg(" in tail
    assert "di_rcp_nr(" in tail and "comb[" in tail and "cnt[((int)blockIdx.x)] = 0;" in tail


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_mixes_take_one_launch_up_to_the_counters_and_two_beyond(monkeypatch):
    from deepinfer.kernels.tilelang import mhc as wrap

    launched = []
    monkeypatch.setattr(wrap, "jit", lambda builder, *a: launched.append((builder.__name__, a)) or (lambda *t: None))
    n = (2 + HC) * HC
    fn, scale, base = torch.zeros(n, HC * D), torch.ones(3), torch.zeros(n)
    for tokens in (1, 65):
        launched.clear()
        wrap.mixes_with_splits(torch.zeros(tokens, HC, D), fn, scale, base, 1e-6, ITERS, 1e-6, 64)
        assert launched == [("build_mhc_premix", (HC, D, 64, 64, 64, 5, 128, ITERS, wrap.TILE_COUNTERS))]
    monkeypatch.setattr(wrap, "TILE_COUNTERS", 1)  # 65 tokens are two 64-token tiles
    launched.clear()
    wrap.mixes_with_splits(torch.zeros(65, HC, D), fn, scale, base, 1e-6, ITERS, 1e-6, 64)
    assert [name for name, _ in launched] == ["build_mhc_premix", "build_mhc_mix_finalize"]
    assert launched[0][1] == (HC, D, 64, 64, 64, 5)


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_gemv_mixes_hold_fn_in_registers_and_finalize_in_the_last_block():
    """mhc_gemv_kernel: each thread loads its column of fn's 24 rows once (before the programmatic wait when early),
    forms a token's dots and sum of squares in fp32 FMAs, the warps reduce by shuffles and add in warp order; the
    last of the 160 blocks sums the partials in block order past L1, finalizes and zeroes the counter."""
    from lowering_helpers import lower_source

    ks = _kernels()
    for name in ("mixes_gemv", "mixes_gemv_early"):
        body = lower_source(ks[name](), "sm_90a")
        body = body[body.index("__global__"):]
        loads = body.index("f[n] = fn[")
        tok = body.index("for (int t = 0; t < n_tok; ++t)")
        assert loads < tok and "__shfl_xor_sync" in body and "wgmma" not in body
        if name.endswith("early"):
            assert loads < body.index("cudaGridDependencySynchronize()") < tok
        tail = body[body.index("AtomicAddRet("):]
        assert "== 159)" in tail and "for (int s = 0; s < 160; ++s)" in tail and "di_ld_cg(" in tail
        assert "di_rcp_nr(" in tail and "cnt[0] = 0;" in tail


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_mixes_take_the_gemv_up_to_its_tokens_outside_the_invariant_mode(monkeypatch):
    from deepinfer.kernels import registry
    from deepinfer.kernels.tilelang import mhc as wrap

    launched = []
    monkeypatch.setattr(wrap, "jit", lambda builder, *a: launched.append(builder.__name__) or (lambda *t: None))
    n = (2 + HC) * HC
    fn, scale, base = torch.zeros(n, HC * D), torch.ones(3), torch.zeros(n)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))  # the kernel path's device check
    monkeypatch.setattr(wrap, "pdl_enabled", lambda: False)

    def route(tokens):
        launched.clear()
        wrap.mhc_mixes(torch.zeros(tokens, HC, D, dtype=torch.bfloat16), fn, scale, base, 1e-6, ITERS, 1e-6)
        return launched[0]

    assert wrap.GEMV_TOKENS == 4
    assert [route(t) for t in (1, 4, 5)] == ["build_mhc_mixes_gemv"] * 2 + ["build_mhc_premix"]
    monkeypatch.setattr(wrap, "GEMV_TOKENS", 0)
    assert route(1) == "build_mhc_premix"
    monkeypatch.setattr(wrap, "GEMV_TOKENS", 8)
    assert [route(t) for t in (1, 8, 9)] == ["build_mhc_mixes_gemv"] * 2 + ["build_mhc_premix"]
    monkeypatch.setitem(registry._MODE, "batch_invariant", True)
    assert route(1) == "build_mhc_premix"
