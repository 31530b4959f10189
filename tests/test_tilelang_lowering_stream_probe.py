"""CPU checks of the weight-streaming probe (kernels/tilelang/stream_probe_kernel.py, benchmarks/stream_probe_gpu.py):
each data path lowers for sm_90a with the copies and waits it names, and ptxas keeps it in registers with no spill
at the occupancy its shared memory allows."""

import importlib.util
import shutil

import pytest

tilelang_missing = importlib.util.find_spec("tilelang") is None
PASSES = {"up": (4608, 5120), "down": (5120, 2304)}
COPIES = {"block": ("cp.async.cg.shared.global", "__syncthreads"), "warp": ("cp.async.cg.shared.global", "__syncwarp"),
          "rows": ("cp.async.bulk.shared::cluster.global", "mbarrier.try_wait"),
          "tile": ("cp.async.bulk.shared::cluster.global", "mbarrier.try_wait"),
          "tma2d": ("cp.async.bulk.tensor.2d.shared::cluster.global", "mbarrier.try_wait")}


@pytest.mark.skipif(tilelang_missing or shutil.which("nvcc") is None, reason="needs tilelang and nvcc")
@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("mode", list(COPIES))
def test_each_data_path_lowers_with_its_copies_and_no_spill(mode, stages, tmp_path):
    from lowering_helpers import lower_source, ptxas_report
    from deepinfer.kernels.tilelang import stream_probe_kernel as sp

    n, k = PASSES["up"]
    src = lower_source(sp.build_stream_probe(mode, 384, n, k, 256, stages), "sm_90a")
    copy, wait = COPIES[mode]
    assert copy in src and wait in src
    log, regs = ptxas_report(src, tmp_path)
    blocks = (227 * 1024) // (sp.shared_bytes(mode, k, 256, stages) + 1024)
    assert "0 bytes spill stores" in log and regs * sp.threads(mode) * min(blocks, 8) <= 65536, (regs, blocks)


@pytest.mark.skipif(tilelang_missing, reason="tilelang is not installed")
def test_the_bulk_paths_copy_whole_16_byte_runs_of_both_passes():
    """A bulk copy moves multiples of 16 bytes from 16-byte-aligned addresses: a row's stage (128 bytes), a
    block's scales (64 rows x K/32: 10,240 / 4,608 bytes, at multiples of that)."""
    from deepinfer.kernels.tilelang import stream_probe_kernel as sp

    for n, k in PASSES.values():
        assert (sp.ROWS * k // 32) % 16 == 0 and (256 // 2) % 16 == 0
        assert sp.shared_bytes("rows", k, 256, 8) <= 227 * 1024
