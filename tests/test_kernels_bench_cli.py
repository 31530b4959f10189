"""benchmarks/kernels_gpu.py refuses a bad --batches with a one-line error and exit code 2, before it touches a GPU,
and writes the issue's kernel targets from the rows it measured."""

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


def test_the_table_writes_issue_21s_kernel_targets_from_its_rows():
    """targets(rows): the decode attention kernel's roofline fraction at B=64 / 256 (32K, one query a sequence) and
    the MoE's bandwidth fraction at B=1 / 8 / 64; a row that did not run is measured None, not met."""
    sys.path.insert(0, str(SCRIPT.parent))
    import kernels_gpu

    rows = [dict(kernel="attn_decode", shape="B=64 q/seq=1 ctx=32K", frac_roofline=0.55),
            dict(kernel="attn_decode", shape="B=64 q/seq=4 ctx=32K", frac_roofline=0.9),
            dict(kernel="moe_experts", shape="B=1 fp4x384+fp8 shared", frac_bw=0.67),
            dict(kernel="mhc_mixes", shape="T=1 hc=4 D=5120", frac_roofline=0.05)]
    got = {t["name"]: (t["measured"], t["met"]) for t in kernels_gpu.targets(rows)}
    assert got == {"decode attention kernel at B=64, 32K, % of its roofline": (pytest.approx(55.0), True),
                   "decode attention kernel at B=256, 32K, % of its roofline": (None, False),
                   "MoE decode at B=1, % of copy bandwidth": (67.0, False),
                   "MoE decode at B=8, % of copy bandwidth": (None, False),
                   "MoE decode at B=64, % of copy bandwidth": (None, False)}
    assert all(set(t) == {"name", "measured", "target", "unit", "met"} for t in kernels_gpu.targets(rows))
