"""Every kernel the 40-layer Flash runs build, as ptxas builds it for sm_90a: no build where ptxas gives up the
asynchronous MMA pipeline ("Potential Performance Loss: wgmma.mma_async instructions are serialized", C7510-C7520).
ptxas says it only as an info line, and the kernel then still computes the right numbers, slower: the prefill expert
GEMM ran so on a device for a session before this check (hopper-sessions.md, the twenty-seventh session). The kernels
are benchmarks/jit/flash40.jsonl's (what the 40-layer runs compiled): each builder's first and last listed shapes.
Slow (~50 compiles); needs tilelang and nvcc, no GPU."""

import ast
import concurrent.futures
import importlib
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None,
                       reason="needs tilelang and nvcc"),
]

MANIFEST = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "jit" / "flash40.jsonl"


def _specs() -> list[tuple[str, str]]:
    by_builder: dict[str, list[str]] = {}
    for line in MANIFEST.read_text().splitlines():
        d = json.loads(line)
        by_builder.setdefault(d["builder"], []).append(d["args"])
    return sorted({(b, a) for b, args in by_builder.items() for a in (args[0], args[-1])})


def _lowered(builder: str, args: str) -> str:
    from lowering_helpers import lower_source

    module, name = builder.split(":")
    values = ast.literal_eval(args)
    prim = getattr(importlib.import_module(module), name)(*(values if isinstance(values, tuple) else (values,)))
    return lower_source(prim, "sm_90a")


def _ptxas(src: str) -> str:
    from lowering_helpers import ptxas_report

    with tempfile.TemporaryDirectory() as tmp:
        return ptxas_report(src, pathlib.Path(tmp))[0]


def test_no_flash_kernel_build_serialises_its_mmas():
    specs = _specs()
    assert len(specs) >= 40, len(specs)  # the manifest lists the 40-layer runs' ~26 builders
    sources = {spec: _lowered(*spec) for spec in specs}  # lowered one at a time, compiled in parallel
    workers = max(1, min(8, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        logs = dict(zip(sources, pool.map(_ptxas, sources.values())))
    serialised = {f"{b.split(':')[1]}{a}": [ln.strip() for ln in log.splitlines() if "Performance Loss" in ln]
                  for (b, a), log in logs.items() if "Performance Loss" in log}
    assert not serialised, serialised
