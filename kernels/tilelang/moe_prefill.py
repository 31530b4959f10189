"""MoE at prefill sizes: the touched experts dequantised to bf16 a chunk at a time (expert_dequant_kernel) and run
through torch's grouped tensor-core GEMM (`torch._grouped_mm`, CUTLASS on sm90), tokens permuted by expert on the
device.

Why a second path beside the streaming kernel (moe_kernel.py): that kernel dequantises each weight tile into
registers once per token tile of <= 64 tokens, which is what decode wants (weights read once, few tokens). At a
prefill step's hundreds of tokens per expert the same weights are dequantised again for every token tile and the
64-row tiles leave the tensor cores idle; dequantising once to bf16 (2.5 bytes per weight written and read back)
and letting a grouped GEMM with large tiles do the arithmetic costs less from `PREFILL_TOKENS` tokens per call
(benchmarks/prefill_kernels_gpu.py measures both). Not the end state: an FP4 grouped GEMM that dequantises in
registers with large token tiles would skip the bf16 round trip.

Same math as the torch reference (kernels/torch/moe.py): gate and up rounded to bf16 by the GEMM, SwiGLU with the
clamp and the routing weight in fp32, the product rounded to bf16 before the down projection, its bf16 output
added in fp32 in ascending expert order, then the shared expert. The GEMMs' tiles follow the token counts, so
this path is never taken in the batch-invariant mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels import registry
from deepinfer.kernels.packed_experts import BLOCK_N, PackedExperts, _dequant
from deepinfer.kernels.torch import moe as torch_moe

from ._build import jit
from .expert_dequant_kernel import build_fp4_rows_dequant

PREFILL_TOKENS = 6144  # tokens per call from which the grouped path runs (the crossover measured on an H200)
EXPERTS_PER_CHUNK = 32  # bf16 scratch per chunk: 32 x (3 x 5120 x 2304) x 2 B = 2.3 GB at V4.1-Flash's shapes
ROW_ALIGN = 16  # each expert's rows start on a multiple of this (the grouped GEMM's M alignment)


def wanted(n_tok: int) -> bool:
    return n_tok >= PREFILL_TOKENS and not registry.batch_invariant() and hasattr(torch, "_grouped_mm")


def dense_rows(fmt: str, w: torch.Tensor, s: torch.Tensor, cols: int) -> torch.Tensor:
    """Experts [C, R, ...] as stored -> [C, R, cols] bf16 (the FP4 kernel on CUDA; FP8, or off CUDA, torch)."""
    C, R = w.shape[:2]
    if fmt != "fp4" or not w.is_cuda:
        return torch.stack([_dequant(fmt, w[c], s[c]).to(torch.bfloat16) for c in range(C)])
    out = torch.empty(C * R, cols, dtype=torch.bfloat16, device=w.device)
    jit(build_fp4_rows_dequant, cols)(w.reshape(C * R, -1), s.reshape(C * R, -1), out)
    return out.view(C, R, cols)


def moe_experts_grouped(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, routed: PackedExperts,
                        shared: PackedExperts | None, swiglu_limit: float) -> torch.Tensor:
    """x [T, D] bf16, router weights/idx [T, k] -> [T, D] bf16 (moe_experts' contract)."""
    T_, k = idx.shape
    E, I, D = routed.n_experts, routed.inter, routed.hidden
    dev = x.device
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments by expert, tokens ascending within one
    expert = flat[order]
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    ends = torch.cumsum(padded, 0)
    dest = (ends - padded)[expert] + torch.arange(T_ * k, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    ends_host = ends.tolist()  # one device sync per call: prefill steps run eagerly
    total = ends_host[-1]
    tok = order // k
    xs = torch.zeros(total, D, dtype=x.dtype, device=dev)  # padding rows stay zero (their outputs are never read)
    xs.index_copy_(0, dest, x[tok])
    aw = torch.zeros(total, 1, dtype=torch.float32, device=dev)
    aw.index_copy_(0, dest, weights.reshape(-1, 1)[order].float())
    out = torch.empty(total, D, dtype=x.dtype, device=dev)  # each assignment's down-projection output
    limit = float(swiglu_limit)
    for lo in range(0, E, EXPERTS_PER_CHUNK):
        hi = min(E, lo + EXPERTS_PER_CHUNK)
        a0, a1 = (ends_host[lo - 1] if lo else 0), ends_host[hi - 1]
        if a1 == a0:
            continue
        offs = (ends[lo:hi] - a0).to(torch.int32)
        w13 = dense_rows(routed.fmt, routed.w13[lo:hi], routed.s13[lo:hi], D)
        h = torch._grouped_mm(xs[a0:a1], w13.transpose(-2, -1), offs=offs)  # [A, 2I], gate/up interleaved
        del w13
        h = h.view(a1 - a0, 2 * I // BLOCK_N, 2, BLOCK_N // 2)
        gate, up = h[:, :, 0].reshape(-1, I).float(), h[:, :, 1].reshape(-1, I).float()
        if limit > 0:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act = (F.silu(gate) * up * aw[a0:a1]).to(x.dtype)
        w2 = dense_rows(routed.fmt, routed.w2[lo:hi], routed.s2[lo:hi], I)
        out[a0:a1] = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    # a token's experts summed in ascending expert order, then the shared expert: the reference's order
    row_of = torch.empty(T_ * k, dtype=torch.int64, device=dev)
    row_of[order] = dest
    rows = row_of.view(T_, k).gather(1, torch.argsort(idx, dim=1))
    y = out[rows[:, 0]].float()
    for j in range(1, k):
        y += out[rows[:, j]].float()
    if shared is not None:
        y += torch_moe.swiglu_expert(x, *shared.dense(0, x.dtype), limit).float()
    return y.to(x.dtype)
