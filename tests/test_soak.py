"""The soak benchmark's short form (benchmarks/soak.py; its recorded run is benchmarks/results/soak_cpu.json.xz):
mixed traffic through `python -m deepinfer serve=openai` under a supervisor, with every fault of the schedule (idle
connections at a 1024 open-file limit, oversized bodies, a grammar flood, the engine core stopped, then killed).
Nothing is lost or hung, the server never crashes (it exits 1 only when its engine dies, and is restarted), invalid
requests get a 4xx, and /health reports the stopped core."""

from __future__ import annotations

import importlib.util
import json
import lzma
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


@pytest.mark.slow  # a server started three times and 30 s of traffic
@pytest.mark.timeout(600)
def test_a_short_soak_loses_nothing_and_never_crashes(tmp_path):
    out = tmp_path / "soak.json"
    soak.main(["--duration", "30", "--rate", "3", "--idle-connections", "300", "--request-timeout", "120",
               "--run-dir", str(tmp_path / "runs"), "--out", str(out)])
    summary = json.loads(out.read_text())
    targets = {t["name"].split(" (")[0]: t for t in summary["targets"]}
    for name in ("crashes", "lost requests", "hung requests", "invalid requests not answered 4xx",
                 "server up through idle connections at a 1024 open-file limit", "stopped core reported by /health"):
        assert targets[name]["met"], (name, targets[name], summary["examples_not_completed"])
    assert sum(summary["outcomes"].values()) == 90 and summary["outcomes"].get("completed", 0) > 0
    assert summary["server_starts"] >= 2 and all(e["code"] == 1 for e in summary["server_exits"])
    # the plot needs matplotlib, which is not a project dependency (its absence is tested below)
    assert out.with_suffix(".png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_the_plot_is_skipped_without_matplotlib_and_said_so(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert soak.plot([], {"faults": [], "rss_series": []}, tmp_path / "x.png") is False
    assert not (tmp_path / "x.png").exists()


def test_only_exit_1_after_a_core_fault_is_an_expected_server_exit():
    line = "deepinfer: error: the engine stopped (the engine core process (pid 7) exited with code -9); ..."
    faults = [{"fault": "sigkill", "t": 100.0}, {"fault": "idle_connections", "t": 10.0}]
    exits = [{"t": 101.0, "code": 1, "last_line": line},  # the core's death, restarted: expected
             {"t": 12.0, "code": 1, "last_line": "OSError: [Errno 24] Too many open files"},  # EMFILE: a crash
             {"t": 300.0, "code": 1, "last_line": line},  # long after any core fault: a crash
             {"t": 102.0, "code": -11, "last_line": line}]
    assert [e["expected"] for e in soak.classify_exits(exits, faults)] == [True, False, False, False]


def test_the_floods_enums_are_prefixed_ids_the_trie_shares_or_hashes_it_leaves_flat():
    """--flood-values: "prefixed" floods compile small as tries (sampling/literal_trie.py), "unshared" ones as large
    as xgrammar makes them, so a soak can measure the server with either."""
    import xgrammar as xgr

    from deepinfer.sampling.literal_trie import factor_literal_alternations

    for kind, as_trie in (("prefixed", True), ("unshared", False)):
        values = [soak.flood_value(kind, "127.0.0.2", 3, i) for i in range(2000)]
        assert len(set(values)) == 2000
        grammar = str(xgr.Grammar.from_json_schema(json.dumps({"enum": values})))
        assert (factor_literal_alternations(grammar) is not None) is as_trie, kind


def test_a_recorded_runs_plot_is_drawn_from_its_json(tmp_path):
    pytest.importorskip("matplotlib")
    summary = {"faults": [{"fault": "sigkill", "t": 20.0}],
               "latency_windows": [{"t": 0.0, "completed": 3, "p50_s": 0.2, "p99_s": 0.5, "max_s": 0.6},
                                   {"t": 10.0, "refused": 2, "p50_s": None, "p99_s": None, "max_s": None}],
               "rss_series": [{"t": 1.0, "server_mb": 280.0, "core_mb": 370.0, "instance": 1}]}
    path = tmp_path / "soak.json"
    path.write_text(json.dumps(summary))
    assert soak.main(["--plot-from", str(path)]) == 0
    assert path.with_suffix(".png").stat().st_size > 0


def test_a_compressed_recorded_runs_plot_goes_beside_it_named_without_its_suffixes(tmp_path, monkeypatch):
    """A recorded run over 8 KB is committed as x.json.xz (tests/test_results_dir.py): read as it is, PNG x.png."""
    drawn = []
    monkeypatch.setattr(soak, "plot", lambda run, summary, png: drawn.append((summary, png)) or True)
    path = tmp_path / "soak.json.xz"
    with lzma.open(path, "wt") as f:
        json.dump({"faults": [], "rss_series": []}, f)
    assert soak.main(["--plot-from", str(path)]) == 0
    assert drawn == [({"faults": [], "rss_series": []}, tmp_path / "soak.png")]
