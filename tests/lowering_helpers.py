"""What the CPU lowering tests (tests/test_tilelang_lowering*.py) lower kernels with: TileLang's CUDA C++ source of
a prim_func for an architecture, with the pass configs the kernels are compiled with, and no GPU; and ptxas's
report on that source where nvcc is installed."""

from __future__ import annotations

import subprocess

from deepinfer.kernels.tilelang._build import PASS_CONFIGS, target


def lower_source(prim_func, arch: str) -> str:
    import tilelang

    from tvm import transform

    tgt = target(arch)
    with tgt, transform.PassContext(opt_level=3, config=PASS_CONFIGS):
        art = tilelang.lower(prim_func, target=tgt)
    return art.kernel_source


def ptxas_report(src: str, tmp_path) -> tuple[str, int]:
    """(ptxas -v's log, registers a thread) for lowered sm_90a source, compiled by nvcc in tmp_path; a failed
    compile fails the calling test with nvcc's message."""
    from tilelang import env

    cu = tmp_path / "k.cu"
    cu.write_text(src)
    cmd = ["nvcc", "-std=c++20", "-cubin", "-gencode", "arch=compute_90a,code=sm_90a", "--ptxas-options=-v",
           f"-I{env.TILELANG_TEMPLATE_PATH}", f"-I{env.CUTLASS_INCLUDE_DIR}", "-o", str(tmp_path / "k.cubin"), str(cu)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    log = res.stdout + res.stderr
    return log, int(log.split("Used ")[1].split(" registers")[0])
