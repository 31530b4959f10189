"""benchmarks/with_attrs.py: a benchmark script run with module constants overridden (same-machine A/Bs)."""

import subprocess
import sys
from pathlib import Path

WRAPPER = Path(__file__).resolve().parents[1] / "benchmarks" / "with_attrs.py"


def _run(tmp_path, *args):
    script = tmp_path / "show.py"
    script.write_text("import sys\nfrom deepinfer.kernels.tilelang import linear\n"
                      "print('seen', linear.TILE_COUNTERS, linear.DENSE_ROWS, sys.argv[1:])\n")
    return subprocess.run([sys.executable, str(WRAPPER), *args, "--", str(script), "x", "--y"],
                          capture_output=True, text=True, timeout=120)


def test_the_script_sees_the_overrides_and_its_own_arguments(tmp_path):
    res = _run(tmp_path, "deepinfer.kernels.tilelang.linear.TILE_COUNTERS=0",
               "deepinfer.kernels.tilelang.linear.DENSE_ROWS=128")
    assert res.returncode == 0, res.stderr
    assert "seen 0 128 ['x', '--y']" in res.stdout


def test_an_unknown_constant_or_a_malformed_override_is_one_line_and_exit_2(tmp_path):
    for bad in ("deepinfer.kernels.tilelang.linear.NO_SUCH=1", "deepinfer.kernels.tilelang.linear.DENSE_ROWS=x",
                "no_such_module.X=1"):
        res = _run(tmp_path, bad)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, (bad, res.stderr)
        assert "seen" not in res.stdout
