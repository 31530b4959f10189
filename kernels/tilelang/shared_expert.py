"""The shared expert at prefill sizes (the grouped prefill MoE, and moe.py from SHARED_DENSE_TOKENS tokens): its w13
dequantised as stored (gate and up rows interleaved) and multiplied by cuBLAS in one GEMM, the SwiGLU over the
GEMM's interleaved halves in one pass (swiglu_kernel.py), then w2.

Why: as torch's swiglu_expert over PackedExperts.dense it was two GEMMs over w1 and w3 copied out of the interleave,
then fp32 casts, two clamps, silu, the product and the bf16 cast as separate passes over [tokens, I]: ~64 ms of
elementwise kernels in a 40-layer 32K prefill on an H100 (prefill_gpu_flash40_s34_h100's profile), where this
pass reads the GEMM output once. Same function as the torch reference: each output the bf16 GEMM value of its own
weight row, the same fp32 operations (the GEMM's accumulation order is cuBLAS's either way)."""

import torch
import torch.nn.functional as F

from deepinfer.kernels.packed_experts import BLOCK_N, PackedExperts
from deepinfer.kernels.registry import fall_back
from deepinfer.kernels.torch.linear import linear

from ._build import jit
from .linear import expert_dense
from .swiglu_kernel import HALF, build_swiglu_halves

assert BLOCK_N // 2 == HALF, "the kernel's halves are PackedExperts' interleave"


def swiglu_halves_torch(h: torch.Tensor, limit: float) -> torch.Tensor:
    """h [T, 2I] (gate and up columns interleaved as w13's rows) -> bf16 silu(min(g, L)) * clamp(u, +-L) [T, I]."""
    t = h.view(h.shape[0], -1, 2, HALF).float()
    gate, up = t[:, :, 0], t[:, :, 1]
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return (F.silu(gate) * up).to(h.dtype).reshape(h.shape[0], -1)


def swiglu_halves(h: torch.Tensor, limit: float) -> torch.Tensor:
    """swiglu_halves_torch's function: the kernel for bf16 on CUDA (another dtype there: a counted fallback)."""
    if not h.is_cuda or h.shape[0] == 0:
        return swiglu_halves_torch(h, limit)
    if h.dtype != torch.bfloat16 or not h.is_contiguous():
        return fall_back("swiglu_halves", f"{h.dtype} / contiguous={h.is_contiguous()}, the kernel takes contiguous "
                         "bfloat16", swiglu_halves_torch, h, limit)
    y = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    jit(build_swiglu_halves, h.shape[1] // 2)(h, y, float(limit))
    return y


def shared_expert(x: torch.Tensor, shared: PackedExperts, limit: float) -> torch.Tensor:
    """x [T, D] -> [T, D]: torch moe.swiglu_expert over `shared`'s one expert, its gate and up in one GEMM."""
    w13, w2 = expert_dense(shared, 0, x.dtype)
    return linear(swiglu_halves(linear(x, w13), limit), w2)
