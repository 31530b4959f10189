"""CPU check of programmatic dependent launch (`DEEPINFER_PDL`, kernels/tilelang/_build.py): where a kernel waits for
the kernel before it, in the CUDA source TileLang makes for sm_90a, without a GPU."""

import importlib.util
import sys

import pytest

from deepinfer.kernels.tilelang._build import pdl_enabled

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")

WAIT, TRIGGER = "cudaGridDependencySynchronize();", "cudaTriggerProgrammaticLaunchCompletion();"


def _source(prim_func):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from lowering_helpers import lower_source

    src = lower_source(prim_func, "sm_90a")
    return src[src.index("__global__ void __launch_bounds__"):]


def test_a_kernel_waits_for_the_one_before_it_before_touching_memory():
    from deepinfer.kernels.tilelang._build import with_pdl
    from deepinfer.kernels.tilelang.rowwise_kernel import build_rope

    src = _source(with_pdl(build_rope(512, 64, False)))
    assert src.count(WAIT) == 1 and src.count(TRIGGER) == 1
    assert src.index(WAIT) < src.index(TRIGGER) < src.index("x + ")  # x: the first buffer it reads


def test_without_pdl_no_kernel_waits():
    from deepinfer.kernels.tilelang.rowwise_kernel import build_rope

    assert WAIT not in _source(build_rope(512, 64, False))


def test_the_gemv_issues_its_weight_loads_before_the_wait_and_reads_activations_after_it():
    from deepinfer.kernels.tilelang._build import with_pdl
    from deepinfer.kernels.tilelang.gemv_kernel import build_fp8_gemv

    src = _source(with_pdl(build_fp8_gemv(4096, 5120, 1, 1, 1, True)))
    assert src.count(WAIT) == 1  # its own wait, not a second one at the top
    assert src.index("w + ") < src.index(WAIT) < src.index("x + ") and src.index(WAIT) < src.index("ws[")
    plain = _source(with_pdl(build_fp8_gemv(4096, 5120, 1, 1, 1, False)))
    assert plain.index(WAIT) < plain.index("w + ")


@pytest.fixture
def pdl_switch(monkeypatch):
    """Sets DEEPINFER_PDL for one test; pdl_enabled reads it afresh, and after the test as the process had it."""
    def set_to(value: str) -> None:
        monkeypatch.setenv("DEEPINFER_PDL", value)
        pdl_enabled.cache_clear()

    yield set_to
    pdl_enabled.cache_clear()


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("off", False), ("", True)])
def test_the_switch_reads_its_variable(pdl_switch, value, on):
    pdl_switch(value)
    assert pdl_enabled() is on


def test_pdl_is_on_by_default(monkeypatch):
    monkeypatch.delenv("DEEPINFER_PDL", raising=False)
    pdl_enabled.cache_clear()
    try:
        assert pdl_enabled() is True
    finally:
        pdl_enabled.cache_clear()


def test_a_bad_switch_value_names_the_variable_and_the_allowed_values(pdl_switch):
    pdl_switch("maybe")
    with pytest.raises(ValueError, match="DEEPINFER_PDL='maybe'; allowed: 1/true/on or 0/false/off"):
        pdl_enabled()


def test_a_bad_switch_value_is_the_configs_one_line_error(pdl_switch):
    from deepinfer.config.compose import compose
    from deepinfer.config.errors import ConfigError
    from deepinfer.config.resolve import resolve

    pdl_switch("2")
    with pytest.raises(ConfigError, match=r"^DEEPINFER_PDL='2'; allowed: 1/true/on or 0/false/off$"):
        resolve(compose([]))
