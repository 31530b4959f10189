"""What the CPU lowering tests (tests/test_tilelang_lowering*.py) lower kernels with: TileLang's CUDA C++ source of
a prim_func for an architecture, with the pass configs the kernels are compiled with, and no GPU."""

from __future__ import annotations

from deepinfer.kernels.tilelang._build import PASS_CONFIGS, target


def lower_source(prim_func, arch: str) -> str:
    import tilelang

    from tvm import transform

    tgt = target(arch)
    with tgt, transform.PassContext(opt_level=3, config=PASS_CONFIGS):
        art = tilelang.lower(prim_func, target=tgt)
    return art.kernel_source
