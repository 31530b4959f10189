"""benchmarks/ep_gpu.py on the CPU (the embedded tiny model, a gloo group of one rank, no graphs): every part runs
(MoE step EP vs single, a dep8 rank's local work, the engine with EP and with host Engram, the prediction) and the
JSON carries its targets and the prediction's arithmetic."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("ep_gpu", ROOT / "benchmarks" / "ep_gpu.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["ep_gpu"] = bench
spec.loader.exec_module(bench)


@pytest.mark.timeout(300)  # ~2 s on an idle 2-core VM (minutes when the cores are shared)
def test_ep_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "ep.json"
    args = ["--device", "cpu", "--model", "tiny", "--batches", "1", "4", "--dep8-batches", "4", "--engram-batch", "4",
            "--max-seqs", "8", "--context", "64", "--iters", "2", "--steps", "2", "--warmup", "1", "--out", str(out)]
    assert bench.main(args) == 0
    res = json.loads(out.read_text())
    assert res["failures"] == []
    assert [r["batch"] for r in res["moe"]] == [1, 4]
    for r in res["moe"]:
        # the capacity of the batch's graph bucket (1 and 4 are buckets): B tokens x min(top-2, 8 experts), one peer
        assert r["ep_capacity_tokens"] == r["batch"] and r["ep_buffer_rows"] == r["batch"] * 2
        assert r["ep_rel_err"] == 0.0  # the CPU path is bitwise
    (d8,) = res["dep8_rank"]
    assert d8["experts_per_rank"] == 1 and d8["buffer_rows"] == 8 * 4  # 8 peers x B=4's bucket x min(2, 1)
    assert 0 < d8["rows_received_per_layer"] <= 8 * 4 * 2
    variants = {(r["variant"], r["batch"]) for r in res["engine"]}
    assert variants == {("single", 4), ("ep", 4), ("single_host_engram", 4)}
    assert res["engram"]["host_table_bytes"] > 0
    cfg = bench.build("tiny", "cpu").config
    for p in res["prediction"]:
        # per layer, 7 peers x 4 rows (B=4's bucket x 1 expert a rank) x (hidden x 2 B twice + 8 B), every layer
        assert p["a2a_bytes_per_step_static"] == cfg.num_hidden_layers * 7 * 4 * (4 * cfg.hidden_size + 8)
        assert p["static"]["tok_s_per_gpu"] > 0 and p["used_rows"]["step_ms"] <= p["static"]["step_ms"]
    names = [t["name"] for t in res["targets"]]
    assert any(n.startswith("host Engram's cost") for n in names)
    assert any(n.startswith("EP decode steps that replayed") for n in names)  # 0 on the CPU: no graphs there
    assert any(n.startswith("dep8 decode prediction") for n in names)
