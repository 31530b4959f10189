"""Every benchmark's JSON carries a top-level `targets` list, one {"name", "measured", "target", "unit", "met"} per
target its issue names, written from what the run measured: each script's `targets` on hand-made rows (one target
met, one missed), and every benchmark that writes a JSON file writes the key."""

import importlib
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

KEYS = {"name", "measured", "target", "unit", "met"}


def judged(entries):
    assert all(set(t) == KEYS for t in entries)
    return [(t["measured"], t["met"]) for t in entries]


def test_batch_invariance_gpu_counts_differing_rows_with_the_mode_on_and_its_b64_decode_cost():
    bench = importlib.import_module("batch_invariance_gpu")
    result = {"default": {"batch 3": dict(rows_differing=37), "decode_step_ms_b64_ctx512": 10.0},
              "invariant": {"batch 3": dict(rows_differing=0), "chunked": dict(rows_differing=0),
                            "decode_step_ms_b64_ctx512": 12.0}}
    assert judged(bench.targets(result)) == [(0, True), (20.0, False)]  # <= 15% over off


def test_parallel_gpu_judges_dep2_over_single_only_at_the_issues_shape():
    bench = importlib.import_module("parallel_gpu")
    assert judged(bench.targets({"ratio": 0.85}, batch=64, world=2)) == [(85.0, True)]
    assert judged(bench.targets({"ratio": 0.5}, batch=64, world=2)) == [(50.0, False)]
    assert bench.targets({"ratio": 0.9}, batch=8, world=2) == []  # the CPU smoke's batch: no target named
    assert bench.targets({}, batch=64, world=2) == []  # a rank failed: nothing measured


def test_throughput_judges_cpu_scheduling_share_and_async_gpu_idle():
    bench = importlib.import_module("throughput")
    row = dict(scheduling_share=0.05, step_gap_ms_mean=0.6, device_ms_per_step=10.0)
    results = [dict(row, device="cpu", mode="sync"),  # 5% < 10%
               dict(row, device="cuda", mode="sync"),  # idle is judged with async scheduling only
               dict(row, device="cuda", mode="async")]  # 6% idle > 5%
    assert judged(bench.targets(results, max_num_seqs=64)) == [(5.0, True), (6.0, False)]
    assert judged(bench.targets(results[:1], max_num_seqs=32)) == []  # the issue's bound is at batch 64


def test_trained_model_judges_greedy_k5_accepted_length_and_teacher_forced_agreement():
    bench = importlib.import_module("trained_model")

    def row(variant, drafts, length, temperature=0.0, varlen=False):
        return dict(variant=variant, drafts=drafts, mean_accepted_length=length, temperature=temperature,
                    varlen=varlen)

    rows = [row("plain", 0, None), row("dspark k=5", 5, 2.6), row("dspark k=5 varlen", 5, 1.0, varlen=True),
            row("dspark k=5", 5, 1.0, temperature=0.7), row("dspark k=5 batch 1", 5, 2.2)]
    assert judged(bench.targets(rows, {"teacher_forced_agreement": 0.978})) == [(2.6, True), (2.2, False),
                                                                                 (97.8, True)]
    assert len(bench.targets(rows, None)) == 2  # no --agreement: no agreement entry


def test_layer_gpu_judges_b1_and_b64_decode_against_the_roofline_and_torch():
    bench = importlib.import_module("layer_gpu")

    def row(backend, batch, layer_ms, floor_ms, mode="decode"):
        return dict(mode=mode, backend=backend, batch=batch, context=4096, layer_ms=layer_ms,
                    floor=[dict(ms=x) for x in floor_ms])

    rows = [row("tilelang", 1, [1.0, 1.0], [0.3, 0.3]),  # 30% < 50%
            row("tilelang", 64, [1.0, 1.0], [0.6, 0.5]),  # 55%
            row("torch", 64, [15.0, 15.0], [0.6, 0.5]),  # 15x the TileLang step
            row("tilelang", 8, [1.0, 1.0], [0.9, 0.9]),  # no target at B=8
            row("tilelang", 1, [1.0, 1.0], [0.9, 0.9], mode="prefill"),
            dict(mode="decode", backend="tilelang", batch=1, context=32768, error="out of memory")]
    assert judged(bench.targets(rows)) == [(30.0, False), (55.0, True), (15.0, True)]


def test_every_benchmark_that_writes_json_writes_targets():
    writes = re.compile(r"json\.dump|portable_json\(")
    has_targets = re.compile(r"""["']targets["']|\btargets\s*=""")
    writers = [p for p in sorted(BENCH.glob("*.py")) if writes.search(p.read_text())]
    assert len(writers) > 20
    assert [p.name for p in writers if not has_targets.search(p.read_text())] == []
