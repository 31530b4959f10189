"""What the run summary learns about the kernels: every call a kernel backend hands to the torch op is counted per
(kind, reason) and travels with the engine's step stats; the TileLang JIT cache lives where
DEEPINFER_JIT_CACHE_DIR says and its compile counters start at zero."""

import importlib.util

import pytest
import torch

from deepinfer.engine.messages import StepStats
from deepinfer.engine.metrics import RunMetrics, kernel_lines
from deepinfer.kernels import registry
from deepinfer.kernels.torch import norm as torch_norm

tilelang_missing = importlib.util.find_spec("tilelang") is None


def _calls(kind, reason):
    return registry.fallback_counts().get(kind, {}).get(reason, 0)


def test_fall_back_runs_the_torch_op_and_counts_the_call_per_kind_and_reason(caplog):
    x = torch.randn(3, 128)
    before = _calls("rms_norm", "test: width not covered")
    with caplog.at_level("WARNING", logger="deepinfer.kernels"):
        out = registry.fall_back("rms_norm", "test: width not covered", torch_norm.rms_norm, x, None, 1e-6)
        registry.fall_back("rms_norm", "test: width not covered", torch_norm.rms_norm, x, None, 1e-6)
    assert torch.equal(out, torch_norm.rms_norm(x, None, 1e-6))
    assert _calls("rms_norm", "test: width not covered") == before + 2
    assert sum("test: width not covered" in r.getMessage() for r in caplog.records) <= 1  # logged once per pair


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_a_tilelang_op_given_cpu_input_falls_back_counted():
    from deepinfer.kernels.tilelang import rowwise

    x = torch.randn(2, 256)
    before = _calls("rms_norm", "input not on CUDA")
    assert torch.equal(rowwise.rms_norm(x, None, 1e-6), torch_norm.rms_norm(x, None, 1e-6))
    assert _calls("rms_norm", "input not on CUDA") == before + 1


def test_opset_summary_shows_per_call_fallbacks_of_kernel_backends_only():
    registry.fall_back("rope", "test: positions not covered", lambda: None)
    ops = registry.OpSet(device="cuda", chosen={k: "torch" for k in registry.OP_KINDS} | {"rope": "tilelang-sm90"})
    assert "rope" in ops.fallback_counts() and "rms_norm" not in ops.fallback_counts()  # torch-run kinds: no count
    assert ops.summary()["rope"].startswith("tilelang-sm90 (") and "calls fell back to torch" in ops.summary()["rope"]
    assert ops.summary()["rms_norm"] == "torch"


def test_step_stats_carry_the_engine_process_counters_into_the_run_summary():
    registry.fall_back("moe_experts", "test: experts not packed", lambda: None)
    step = StepStats(0, 1, 4, 0, 0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.1)
    assert step.kernels["fallbacks"]["moe_experts"]["test: experts not packed"] >= 1
    m = RunMetrics()
    m.steps.append(step)
    summary = m.summary()
    assert summary["kernels"] == step.kernels
    lines = dict(kernel_lines(summary["kernels"]))
    assert "moe_experts: " in lines["per call"] and "(test: experts not packed)" in lines["per call"]


def test_kernel_lines_report_jit_compiles_and_cache_hits():
    lines = kernel_lines({"fallbacks": {}, "jit": {"compiled": 3, "cache_hits": 40, "seconds": 12.34,
                                                   "cache_dir": "/c"}})
    assert lines == [("jit", "3 compiled, 40 from cache, 12.3 s (/c)")]
    assert kernel_lines({"fallbacks": {}, "jit": None}) == []
    off = kernel_lines({"fallbacks": {}, "jit": {"compiled": 0, "cache_hits": 2, "seconds": 0.5, "cache_dir": "/c",
                                                 "pdl": False}})
    assert off == [("jit", "0 compiled, 2 from cache, 0.5 s (/c); PDL off")]  # the launch mode, when not the default
    manifest = {"path": "/m", "listed": 57, "stale": 1, "failed": 2, "seconds": 21.04, "lines": 60}
    listed = kernel_lines({"fallbacks": {}, "jit": {"compiled": 57, "cache_hits": 0, "seconds": 160.0,
                                                    "cache_dir": "/c", "manifest": manifest}})
    assert listed == [("jit", "57 compiled, 0 from cache, 160.0 s (/c); manifest: 57 built in parallel in 21.0 s, "
                              "3 lines skipped")]


def test_jit_cache_dir_follows_deepinfer_jit_cache_dir(monkeypatch, tmp_path):
    from deepinfer.kernels.tilelang import _build

    monkeypatch.delenv("TILELANG_CACHE_DIR", raising=False)
    monkeypatch.delenv("DEEPINFER_JIT_CACHE_DIR", raising=False)
    assert _build.cache_dir().endswith("/.cache/deepinfer/jit")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tl"))
    assert _build.cache_dir() == str(tmp_path / "tl")  # an explicit TileLang setting is kept
    monkeypatch.setenv("DEEPINFER_JIT_CACHE_DIR", str(tmp_path / "di"))
    assert _build.use_cache_dir() == str(tmp_path / "di")
    if not tilelang_missing:
        from tilelang import env

        assert env.TILELANG_CACHE_DIR == str(tmp_path / "di")  # TileLang reads it on every lookup
    stats = _build.jit_stats()
    assert stats["cache_dir"] == str(tmp_path / "di") and stats["compiled"] >= 0 and stats["cache_hits"] >= 0
