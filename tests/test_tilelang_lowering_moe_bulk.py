"""CPU checks of the bulk-copy routed passes (kernels/tilelang/moe_bulk_kernel.py, `moe.BULK_TOKENS`): they lower
for sm_90a with the producer's bulk copies behind mbarriers and mma.sync, ptxas keeps them in registers with no
spill at two blocks an SM, and the launcher takes them only when asked, up to BULK_TOKENS tokens, outside the
batch-invariant mode."""

import importlib.util
import shutil

import pytest
import torch

tilelang_missing = importlib.util.find_spec("tilelang") is None
PASSES = {"up": ("swiglu", 384, 4608, 5120), "down": ("add", 384, 5120, 2304)}


@pytest.mark.skipif(tilelang_missing or shutil.which("nvcc") is None, reason="needs tilelang and nvcc")
@pytest.mark.parametrize("name", list(PASSES))
def test_the_bulk_passes_lower_and_fit_two_blocks_an_sm(name, tmp_path):
    from lowering_helpers import lower_source, ptxas_report
    from deepinfer.kernels.tilelang import moe_bulk_kernel as mb

    args = PASSES[name]
    src = lower_source(mb.build_fp4_bulk_gemm(*args), "sm_90a")
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in src
    assert "mma.sync.aligned.m16n8k16" in src and "wgmma.mma_async" not in src
    log, regs = ptxas_report(src, tmp_path)
    assert "0 bytes spill stores" in log and regs * mb.THREADS * 2 <= 65536, (regs, log[-2000:])
    assert 2 * (mb.shared_bytes(args[3]) + 1024) <= 228 * 1024


def test_the_launcher_takes_the_bulk_passes_only_when_asked(monkeypatch):
    from deepinfer.kernels import registry
    from deepinfer.kernels.packed_experts import PackedExperts
    from deepinfer.kernels.tilelang import moe, moe_bulk_kernel

    E, I, D = 8, 2304, 5120
    u8 = torch.uint8
    p = PackedExperts("fp4", torch.zeros(E, 2 * I, D // 2, dtype=u8), torch.zeros(E, 2 * I, D // 32, dtype=u8),
                      torch.zeros(E, D, I // 2, dtype=u8), torch.zeros(E, D, I // 32, dtype=u8))
    build = moe_bulk_kernel.build_fp4_bulk_gemm
    assert moe.BULK_TOKENS == 0 and moe.routed_specs(p, 1, 6)[0][0] is not build  # off until measured
    monkeypatch.setattr(moe, "BULK_TOKENS", 64)
    for n_tok in (1, 8, 64):
        up, down = moe.routed_specs(p, n_tok, 6)
        assert up == (build, "swiglu", E, 2 * I, D) and down == (build, "add", E, D, I)
        assert up in moe.experts_specs(p, None, n_tok, 6)
    assert moe.routed_specs(p, 65, 6)[0][0] is not build
    monkeypatch.setitem(registry._MODE, "batch_invariant", True)
    assert moe.routed_specs(p, 8, 6)[0][0] is not build
