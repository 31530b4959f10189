"""benchmarks/prefix_cache.py end to end on the CPU in a tiny configuration (slow: two engines, three workloads):
the cache-on engine hits in the shared-prompt and chat workloads and computes fewer prefill tokens, never in the
unshared one, the outputs of both engines are the same token for token, and the JSON carries the issue's four
targets with the figures they were computed from."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    """benchmarks/prefix_cache.py as a module."""
    spec = importlib.util.spec_from_file_location("prefix_cache_bench", ROOT / "benchmarks" / "prefix_cache.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["prefix_cache_bench"] = bench
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_the_prefix_cache_benchmark_runs_on_the_cpu_and_reports_its_targets(tmp_path):
    bench = _bench()
    out = tmp_path / "prefix_cache.json"
    # a 256-token system prompt: a checkpoint boundary of the first request (16 blocks of 16 tokens)
    rc = bench.main(["--shared-tokens", "256", "--shared-requests", "3", "--turns", "3", "--turn-tokens", "20",
                     "--unshared-requests", "2", "--rounds", "2", "--max-tokens", "3", "--block-size", "16",
                     "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["failures"] == []
    W = data["workloads"]
    for name in ("shared", "chat"):
        assert W[name]["on"]["hit_tokens"] > 0 and W[name]["prefill_ratio"] < 1
        assert W[name]["on"]["checkpoint_bytes"] > 0 and W[name]["off"]["checkpoint_bytes"] == 0
    assert W["unshared"]["on"]["hit_tokens"] == 0 and len(W["unshared"]["throughput_ratio_per_round"]) == 2
    assert W["unshared"]["on"]["query_tokens"] == W["unshared"]["on"]["prompt_tokens"]
    names = [t["name"][:3] for t in data["targets"]]
    assert names == ["(a)", "(b)", "(c)", "exa"]
    assert all(set(t) == {"name", "measured", "target", "unit", "met"} for t in data["targets"])
    assert data["targets"][3]["measured"] == 0 and data["targets"][3]["met"]
    assert data["targets"][1]["measured"] == round(W["chat"]["prefill_ratio"], 4)


def test_workloads_runs_only_those_named_and_their_targets(tmp_path):
    bench = _bench()
    out = tmp_path / "prefix_cache.json"
    rc = bench.main(["--workloads", "unshared", "--unshared-requests", "2", "--rounds", "1", "--max-tokens", "2",
                     "--shared-tokens", "64", "--shared-requests", "2", "--turns", "2", "--turn-tokens", "8",
                     "--block-size", "16", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["failures"] == [] and list(data["workloads"]) == ["unshared"]
    assert [t["name"][:3] for t in data["targets"]] == ["(c)", "exa"]
