"""Compile-once plumbing shared by the TileLang kernels.

Every kernel module exposes pure `build_*(...) -> prim_func` builders (no GPU needed) and calls `jit(builder,
*static_args)` at run time. Builders take only hashable static arguments (shapes that fix the tiling, dtypes);
dimensions that change per call (tokens, slots) are symbolic inside the prim_func, so one compiled kernel
serves every batch size.
"""

from __future__ import annotations

import functools
from typing import Callable

# Pass configs every kernel here shares: the dequant / gather loops do their own vectorisation, and the
# auto warp-specialised producer/consumer split fights the hand-placed dequant inside pipelined loops.
PASS_CONFIGS = {"tl.disable_warp_specialized": True}


def cuda_arch(device=None) -> str:
    """'sm_90a' on Hopper (wgmma/TMA need the arch-specific target), 'sm_100a' on B200, else sm_XY."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    return arch + "a" if major in (9, 10) else arch


def target(arch: str):
    from tvm.target import Target

    return Target({"kind": "cuda", "arch": arch})


@functools.lru_cache(maxsize=None)
def jit(builder: Callable, *args):
    """Compile `builder(*args)` for the current GPU once per process (TileLang also caches on disk)."""
    import tilelang

    tgt = target(cuda_arch())
    with tgt:
        return tilelang.compile(builder(*args), target=tgt, pass_configs=PASS_CONFIGS)


def lower_source(prim_func, arch: str) -> str:
    """CUDA C++ source of a prim_func for `arch`, without a GPU (the CPU lowering test uses this)."""
    import tilelang

    from tvm import transform

    tgt = target(arch)
    with tgt, transform.PassContext(opt_level=3, config=PASS_CONFIGS):
        art = tilelang.lower(prim_func, target=tgt)
    return art.kernel_source
