import pytest
import torch

# The tiny test models are dominated by per-op overhead; torch's intra-op thread pool only adds
# contention (a 16x64 GEMM takes ~8 us on one thread and can take >1 ms on two busy cores).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The one GPU-skip hook: tests marked `gpu` (pyproject's markers) are skipped where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def server():
    """An HTTP server on the embedded model (16 sequences), one per test module that asks for it."""
    from serving_helpers import ThreadServer

    srv = ThreadServer(["engine.max_num_seqs=16"])
    yield srv
    srv.close()
