"""benchmarks/parallel_gpu.py on the CPU (gloo, 2 spawned ranks, the embedded tiny model's config): it runs
`single` on the per-rank slice and dep2 (static-capacity dispatch) with the expert-parallel all-to-alls timed,
writes the JSON the issue-13 report reads, and exits non-zero when EP did not actually move tokens to another rank."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("parallel_gpu", ROOT / "benchmarks" / "parallel_gpu.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["parallel_gpu"] = bench  # the spawned ranks unpickle rank_main by this name
spec.loader.exec_module(bench)

ARGS = ["--device", "cpu", "--model", "tiny", "--batch", "8", "--context", "64", "--steps", "3", "--warmup", "1",
        "--bw-mib", "4", "--bw-reps", "3", "--eplb-steps", "40", "--timeout", "60"]


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
def test_dep2_vs_single_on_cpu(tmp_path):
    out = tmp_path / "p.json"
    assert bench.main(ARGS + ["--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["failures"] == []
    cfg = bench.model_config("tiny")
    rows = {(r["variant"], r["rank"]): r for r in res["rows"]}
    assert set(rows) == {("single", 0), ("single", 1), ("dep2", 0), ("dep2", 1)}
    for (variant, rank), r in rows.items():
        assert r["timed_steps"] == 3 and len(r["step_ms_all"]) == 3
        assert 0 < r["step_ms"] < 60_000 and math.isclose(r["tok_s"], 8 / (r["step_ms"] / 1e3))
        # the same per-rank slice: half the routed experts per layer, the same weight bytes up to the router
        # (dep2's gate scores all E experts, the slice's E / 2)
        assert r["n_routed_experts_held"] == cfg.n_routed_experts // 2
        assert math.isclose(r["weights_gb"], rows[("single", rank)]["weights_gb"], rel_tol=0.01)
    for rank in (0, 1):
        d = rows[("dep2", rank)]
        # three all_to_all_single calls per MoE layer on the static path (every layer of the tiny model is MoE)
        assert d["a2a_calls_per_step"] == [3 * cfg.num_hidden_layers] * 3
        assert d["dispatched_rows_to_peer"] > 0 and d["a2a_peer_bytes_per_step"] > 0
        assert 0 < d["a2a_ms"] < d["step_ms"]
        assert math.isclose(sum(d["a2a_ms_by_kind"].values()), d["a2a_ms"], rel_tol=0.5)  # medians of parts
    s = res["summary"]
    assert s["bandwidth_bytes_per_s"] > 0 and s["a2a_floor_ms"] > 0 and 0 < s["a2a_pct_of_bandwidth"]
    assert 0 < s["ratio"] < 10 and s["target_met"] == (s["ratio"] >= 0.8)
    assert math.isclose(s["ratio"], s["dep_tok_s_per_rank"] / s["single_tok_s_per_rank"])
    e = res["eplb"]
    assert e["num_experts"] == cfg.n_routed_experts and e["num_ranks"] == 2
    assert e["policy_after"] < e["policy_before"] and e["dispatched_after"] < e["dispatched_before"]
    assert res["bandwidth"][0]["peer_bytes"] == 2 << 20  # half of the 4 MiB buffer goes to the other rank


def test_exits_nonzero_when_ep_moves_nothing(tmp_path, capsys):
    """One rank: the "expert parallel" all-to-alls run but send no row to another rank, so the run is not what
    it claims and must fail (after writing its JSON)."""
    out = tmp_path / "p1.json"
    assert bench.main(ARGS + ["--world", "1", "--out", str(out)]) == 1
    res = json.loads(out.read_text())
    assert any("sent no token rows" in f for f in res["failures"])
    assert "FAILED" in capsys.readouterr().err
