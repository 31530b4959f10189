"""Scheduling overhead: async (zero-overhead) scheduling plans the next step while the current one runs, so the
device waits less between steps than with synchronous scheduling, for the same outputs; and Python bookkeeping
stays a small share of a step."""

from __future__ import annotations

from pathlib import Path

from deepinfer.engine import EngineOptions, LLMEngine, ModelDirBackend
from deepinfer.sampling import SamplingParams

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")


def run(zero_overhead: bool):
    options = EngineOptions(process="inproc", zero_overhead_scheduling=zero_overhead, max_num_seqs=32, memory_budget=1 << 24)
    prompts = [[0] + [3 + (7 * i + j) % 500 for j in range(6 + i % 5)] for i in range(32)]
    with LLMEngine(ModelDirBackend(MODEL), options) as engine:
        outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        return [o.token_ids for o in outputs], engine.last_metrics


def test_async_scheduling_shrinks_the_gap_between_device_steps_with_identical_outputs():
    sync_tokens, sync = run(zero_overhead=False)
    async_tokens, asyn = run(zero_overhead=True)
    print(
        f"\nbatch 32 decode, device gap between steps p50: sync {1e3 * sync['step_gap_s']['p50']:.3f} ms, "
        f"async {1e3 * asyn['step_gap_s']['p50']:.3f} ms; bookkeeping share of a sync step "
        f"{100 * sync['scheduling_share']:.2f}%"
    )
    assert async_tokens == sync_tokens
    assert asyn["step_gap_s"]["p50"] < sync["step_gap_s"]["p50"]
    assert sync["scheduling_share"] < 0.10
