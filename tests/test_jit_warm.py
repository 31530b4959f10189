"""benchmarks/jit_warm.py, a fresh GPU machine's kernel builds done once in parallel: it refuses a missing manifest
or a machine without a GPU with exit code 2 and a one-line error, and every kernel manifest the repo holds
(benchmarks/jit/*.jsonl) reads back whole: each line a spec whose builder exists (a stale line fails the warm-up)."""

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "jit_warm.py"
MANIFESTS = sorted((ROOT / "benchmarks" / "jit").glob("*.jsonl"))


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_a_missing_manifest_exits_2_naming_it(tmp_path):
    run = _run(str(tmp_path / "none.jsonl"))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == f"jit_warm.py: error: manifests: no such file: {tmp_path}/none.jsonl"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_without_a_gpu_it_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    run = _run(str(MANIFESTS[0]))
    assert run.returncode == 2 and "a GPU is needed" in run.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="the kernel modules need tilelang")
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_every_line_of_a_manifest_names_a_builder_that_exists(manifest):
    from deepinfer.kernels.tilelang._build import read_manifest

    specs, lines, stale = read_manifest(str(manifest))
    assert stale == 0 and len(specs) == len(lines) == len([s for s in manifest.read_text().splitlines() if s.strip()])
    for builder, *args in specs:  # and takes its arguments (a removed parameter would fail the warm-up's build)
        inspect.signature(builder).bind(*args)
