"""benchmarks/attention_decode_gpu.py on the CPU: the kernels it compiles up front (kernel_specs) are the ones the
decode kernel's launcher asks for, as is, with each probe and with each candidate setting, so the parallel
precompile builds what the run uses instead of compiling twice."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    path = ROOT / "benchmarks" / "attention_decode_gpu.py"
    spec = importlib.util.spec_from_file_location("attention_decode_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _asked(monkeypatch, probe="", **knobs):
    """The jit arguments of one launch of the decode kernel at 2 splits (jit recorded, nothing compiled or run),
    with the attention module's constants in `knobs` set for that launch only."""
    from deepinfer.kernels.tilelang import attention

    asked = []

    def jit(*spec):
        asked.append(spec)
        return lambda *a, **k: None

    with monkeypatch.context() as m:
        m.setattr(attention, "jit", jit)
        for k, v in knobs.items():
            m.setattr(attention, k, v)
        _launch(attention, probe)
    return [s for s in asked if s[0].__name__ == "build_sink_attention_decode"]


def _launch(attention, probe):
    n_q, B, P = 2, 2, 64
    attention.sink_attention_decode_kernel(
        torch.zeros(n_q, 64, 512, dtype=torch.bfloat16), torch.zeros(n_q, dtype=torch.int32),
        torch.zeros(n_q, dtype=torch.int32), torch.zeros(B, 128, 512, dtype=torch.uint8),
        torch.zeros(B, 128, 16, dtype=torch.uint8), torch.zeros(B, 128, dtype=torch.int32),
        torch.zeros(P, 256, dtype=torch.uint8), torch.zeros(P, 32, dtype=torch.uint8),
        torch.zeros(n_q, 512, dtype=torch.int32), torch.zeros(64), 0.1, splits=2, probe=probe)


def test_the_precompiled_kernels_are_the_launched_ones(monkeypatch):
    bench = _bench()
    from deepinfer.kernels.tilelang.attention_decode_kernel import PROBES

    probes = [p for p in PROBES if p]
    specs = set(bench.kernel_specs([2], probes, cands=True))
    launched = _asked(monkeypatch)
    for probe in probes:
        launched += _asked(monkeypatch, probe)
    for knobs in bench.CANDIDATES.values():
        launched += _asked(monkeypatch, **knobs)
    assert launched and set(launched) == specs


def test_the_json_carries_the_kernels_target():
    """Issue 21's target for the kernel, one entry per batch, from the rows the run made (None where B=64 or 256 did
    not run at 32K with one query a sequence)."""
    bench = _bench()
    rows = [dict(B=64, q_per_seq=1, ctx=32768, roofline=0.157), dict(B=64, q_per_seq=4, ctx=32768, roofline=0.9),
            dict(B=256, q_per_seq=1, ctx=4096, roofline=0.6)]
    got = bench.targets(rows)
    assert [t["target"] for t in got] == [50.0, 50.0] and all(t["unit"] == "%" for t in got)
    assert got[0]["measured"] == pytest.approx(15.7) and not got[0]["met"]
    assert got[1]["measured"] is None and not got[1]["met"]
    assert bench.targets([dict(B=256, q_per_seq=1, ctx=32768, roofline=0.55)])[1]["met"]
    # a shared pool (--pool-rows: the prefill's L2-resident one) is not the target's shape
    assert bench.targets([dict(B=256, q_per_seq=1, ctx=32768, roofline=0.9, pool_rows=4096)])[1]["measured"] is None


def test_a_shared_pool_gives_every_query_its_rows_from_the_same_first_rows():
    """--pool-rows N: the prefill's shape, where a chunk's queries all select from one sequence's pool; by default
    each sequence selects from its own ctx / 2 rows of one big pool (not L2-resident)."""
    _bench()  # benchmarks/ on sys.path
    import kernels_gpu

    g = torch.Generator().manual_seed(0)
    (own,) = kernels_gpu.attention_inputs(3, 2048, 1, g, dev="cpu")[:1]
    sel = own[8]
    assert own[6].shape[0] == 3 * 1024 and sel.shape == (3, 512)
    for i in range(3):  # sequence i's rows are its own 1024
        assert (sel[i] >= i * 1024).all() and (sel[i] < (i + 1) * 1024).all() and sel[i].unique().numel() == 512
    (shared,) = kernels_gpu.attention_inputs(3, 2048, 1, g, dev="cpu", pool_rows=600)[:1]
    assert shared[6].shape[0] == 600 and shared[7].shape[0] == 600
    assert (shared[8] >= 0).all() and (shared[8] < 600).all() and shared[8].shape == (3, 512)
