"""benchmarks/kernels_gpu.py refuses a bad --batches with a one-line error and exit code 2, before it touches a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_gpu.py"


@pytest.mark.parametrize("value", ["1,x", "0", "4,-1"])
def test_a_bad_batches_list_exits_2_naming_the_flag(value):
    run = subprocess.run([sys.executable, str(SCRIPT), "--batches", value], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (f"kernels_gpu.py: error: --batches: comma-separated positive "
                                                  f"integers, got {value!r}")
