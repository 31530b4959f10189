"""The kernel manifest (DEEPINFER_JIT_MANIFEST, kernels/tilelang/_build.py): a process appends every kernel it
compiles, once; a later process builds every listed kernel on a thread pool at its first jit, skipping and counting
lines the current code cannot build. The compiler is replaced by a recorder: what is specified here is the
bookkeeping around it, which needs no GPU."""

import json
import logging
import os
import threading

import pytest

from deepinfer.kernels.tilelang import _build

BUILT = []  # (builder name, args) in the order the fake compiler saw them


def build_gemm(n, fmt, tile, flag):
    return ("gemm", n, fmt, tile, flag)


def build_norm(dim):
    return ("norm", dim)


BARRIER = threading.Barrier(2, timeout=30)


def build_pair(i):
    """Two of these must be built at the same time, or the barrier breaks (the manifest's build is parallel)."""
    BARRIER.wait()
    return ("pair", i)


def build_rejecting(n):
    assert n % 64 == 0, "the current code no longer accepts this shape"
    return ("rejecting", n)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not called jit yet, a fake compiler, and the manifest at tmp_path / m.jsonl."""
    monkeypatch.setattr(_build, "_MANIFEST_STARTED", False)
    monkeypatch.setattr(_build, "_MANIFEST", {"path": None, "listed": 0, "stale": 0, "failed": 0, "seconds": 0.0,
                                              "known": set()})
    monkeypatch.setattr(_build, "pdl_enabled", lambda: False)
    monkeypatch.setattr(_build, "_compile", lambda prim_func: BUILT.append(prim_func) or ("kernel", prim_func))
    monkeypatch.setattr(_build, "_record", lambda kernel, seconds: None)
    _build._compiled.cache_clear()
    BUILT.clear()
    path = tmp_path / "m.jsonl"
    monkeypatch.setenv("DEEPINFER_JIT_MANIFEST", str(path))
    yield path
    _build._compiled.cache_clear()


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_process_appends_each_kernel_it_compiles_once(fresh):
    assert _build.jit(build_gemm, 3, "fp4", (1, 2), True) == ("kernel", ("gemm", 3, "fp4", (1, 2), True))
    _build.jit(build_gemm, 3, "fp4", (1, 2), True)
    _build.jit(build_norm, 512)
    lines = _lines(fresh)
    assert [entry["builder"] for entry in lines] == [f"{__name__}:build_gemm", f"{__name__}:build_norm"]
    specs, _, stale = _build.read_manifest(str(fresh))
    assert specs == [(build_gemm, 3, "fp4", (1, 2), True), (build_norm, 512)] and stale == 0  # read back as built
    assert _build.jit_stats()["manifest"]["lines"] == 2


def test_a_later_process_builds_every_listed_kernel_in_parallel_before_its_first_kernel(fresh, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    listed = [(build_pair, 0), (build_pair, 1), (build_norm, 128)]
    fresh.write_text("".join(_build.manifest_line(s[0], s[1:]) + "\n" for s in listed)
                     + json.dumps({"builder": f"{__name__}:build_gone", "args": "(1,)"}) + "\n"
                     + "not json\n")
    _build.jit(build_norm, 256)
    assert sorted(BUILT[:3]) == [("norm", 128), ("pair", 0), ("pair", 1)] and BUILT[3] == ("norm", 256)
    stats = _build.jit_stats()["manifest"]
    assert (stats["listed"], stats["stale"], stats["failed"], stats["lines"]) == (3, 2, 0, 4)
    assert json.loads(fresh.read_text().splitlines()[-1])["args"] == "(256,)"  # the listed ones not appended again


def test_a_listed_kernel_the_code_rejects_is_counted_and_logged_not_fatal(fresh, caplog):
    fresh.write_text(_build.manifest_line(build_rejecting, (100,)) + "\n"
                     + _build.manifest_line(build_rejecting, (128,)) + "\n")
    with caplog.at_level(logging.WARNING, logger=_build.__name__):
        assert _build.jit(build_norm, 64) == ("kernel", ("norm", 64))
    stats = _build.jit_stats()["manifest"]
    assert (stats["listed"], stats["failed"]) == (2, 1) and ("rejecting", 128) in BUILT
    assert "1 of 2 kernels failed to build" in caplog.text


def test_an_unreadable_manifest_is_logged_and_the_run_goes_on(fresh, caplog):
    fresh.write_bytes(b"\xff\xfe not text")
    with caplog.at_level(logging.WARNING, logger=_build.__name__):
        assert _build.jit(build_norm, 16) == ("kernel", ("norm", 16))
    assert "not read" in caplog.text and _build.jit_stats()["manifest"] is None


def test_without_the_variable_nothing_is_listed_or_recorded(fresh, monkeypatch):
    monkeypatch.delenv("DEEPINFER_JIT_MANIFEST")
    _build.jit(build_norm, 32)
    assert _build.jit_stats()["manifest"] is None and not fresh.exists()


def test_arguments_that_are_not_plain_literals_are_not_listed():
    assert _build.manifest_line(build_norm, (object(),)) is None
    assert json.loads(_build.manifest_line(build_gemm, (1, "fp8", None, False)))["args"] == "(1, 'fp8', None, False)"
