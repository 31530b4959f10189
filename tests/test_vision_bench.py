"""benchmarks/vision_gpu.py end to end on the CPU (--tiny: the embedded tiny image path and text model), so the H200
run is known not to crash: every stage runs, the JSON has its rows, checks and measurements, and it exits 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_vision_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "vision.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vision_gpu.py"), "--tiny", "--images", "1", "2",
                           "--reps", "1", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["images"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["patches_per_image"] > 0 and r["vit_tokens_per_s"] > 0 and r["rows_device"] == "cpu"
        assert r["image_to_first_token_ms"] > 0 and r["text_same_length_first_token_ms"] > 0
        assert r["prompt_tokens"] == 12 + r["span_tokens_per_image"]
    assert res["targets"] and all(t["met"] is True for t in res["targets"]) and not res["failures"]
    assert {"name", "measured", "target", "unit", "met"} <= set(res["targets"][0])
    assert any("ViT tokens/s" in m["name"] for m in res["measurements"])
    assert res["meta"]["ops"]["vision_attention"] == "torch"
