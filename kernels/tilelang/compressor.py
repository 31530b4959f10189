"""Registry-facing `compressor_pool` on the kernel of compressor_kernel.py. Same signature and result as
deepinfer.kernels.torch.compressor.compressor_pool: the softmax weights and products round as the torch op's, the
sum over the group's tokens runs in ATen's order (compressor_kernel.py), so results agree to the last fp32 bits
(the GPU test bounds the difference and checks both against a float64 reference).

Kernel path: CUDA fp32 kv and gate [rows, D] of one shape on one device, D a multiple of 4, 1 <= ratio <=
MAX_RATIO (rows past the last complete group are ignored, as the torch op does; no complete group gives [0, D]
without a launch); anything else goes to the torch op. No host synchronisation, so decode steps under CUDA-graph
capture can call it. Each thread's work is fixed by its (group, channels): batch-invariant as it is.
"""

import torch

from deepinfer.kernels.registry import fall_back
from deepinfer.kernels.torch import compressor as torch_compressor

from ._build import dense, jit
from ._fallback import reason
from .compressor_kernel import MAX_RATIO, build_compressor_pool


def compressor_pool(kv: torch.Tensor, gate: torch.Tensor, ratio: int) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.compressor.compressor_pool (module docstring for the kernel path)."""
    fast = (kv.is_cuda and kv.dtype == torch.float32 and gate.dtype == torch.float32 and kv.dim() == 2
            and gate.shape == kv.shape and gate.device == kv.device and isinstance(ratio, int)
            and 1 <= ratio <= MAX_RATIO and kv.shape[1] % 4 == 0 and kv.shape[1] > 0)
    if not fast:
        return fall_back("compressor_pool", reason(kv, "ratio or width not covered", (torch.float32,)),
                         torch_compressor.compressor_pool, kv, gate, ratio)
    groups, dim = kv.shape[0] // ratio, kv.shape[1]
    out = torch.empty(groups, dim, dtype=torch.float32, device=kv.device)
    if groups:
        rows = groups * ratio
        jit(build_compressor_pool, ratio, dim)(dense(kv[:rows]).view(groups, ratio, dim),
                                               dense(gate[:rows]).view(groups, ratio, dim), out)
    return out
