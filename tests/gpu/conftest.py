"""GPU test modules start on a GPU the previous module has let go of: the Flash-width models of module fixtures
hold tens of GiB and reference themselves in cycles (modules, op sets, graphs), so after a module's teardown their
memory waits for the cycle collector; a next module that builds its own model first ran out of memory (H200,
2026-12-02: test_expert_parallel_gpu.py after test_engine_batch_invariance.py in one process)."""

import gc

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _previous_module_released():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    yield


@pytest.fixture(params=[False, True], ids=["batch-dependent", "batch-invariant"])
def either_mode(request):
    """The registry's batch-invariant mode off, then on (the mode is the process's, set by OpSet.build); off after."""
    from deepinfer.kernels import registry

    registry.OpSet.build("cuda", ["torch"], batch_invariant=request.param)
    yield request.param
    registry.OpSet.build("cuda", ["torch"], batch_invariant=False)
