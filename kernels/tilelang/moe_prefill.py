"""MoE at prefill sizes: tokens grouped by expert on the device (each expert's rows padded to whole tiles of
`BLOCK_M`; with 64, an expert's tiles paired into 128-row ones), then the FP4 grouped GEMM (expert_gemm_kernel.py)
over every expert at once, one launch per tile height: the gate/up projection with the SwiGLU in its epilogue, and
the down projection. The tile lists are sized by a bound the host knows (tokens x top-k / BLOCK_M + experts), their
unused entries expert -1 (the kernel's blocks for those exit at once): no device sync in the call, where the eager
prefill step would leave the GPU idle while the host launches what follows (6-layer prefill 8K 144 -> 135 ms, H100,
docs/hopper-sessions.md). The gate/up GEMM reads the tokens' rows copied into tile order: reading them in place
through their indices made that GEMM 19% slower than the copy and the GEMM together (40-layer 8K prefill 749.6 vs
728.6 ms, H200, thirty-fifth session; the variant is in git history).

Why a second path beside the streaming kernel (moe_kernel.py): that kernel dequantises each weight tile into
registers once per token tile of <= 64 tokens, which is what decode wants (weights read once, few tokens). At a
prefill step's hundreds of tokens per expert the arithmetic dominates: here each weight fragment, dequantised once
into registers, feeds the wgmma of a 64- or 128-token tile. From `PREFILL_TOKENS` tokens per call this path runs
(benchmarks/prefill_kernels_gpu.py measures both).

Same math as the torch reference (kernels/torch/moe.py): gate and up rounded to bf16 as a GEMM output, SwiGLU with
the clamp and the routing weight in fp32, the product rounded to bf16 before the down projection, its bf16 output
added in fp32 in ascending expert order, then the shared expert. The GEMMs' accumulation order is the kernel's
(not cuBLAS's), and tiles follow the token counts, so this path is never taken in the batch-invariant mode.

`expert_gemm_torch` is the kernel's contract in torch (the same permuted K order, tiles and epilogues): the path
off CUDA, and the reference the GPU test holds the kernel to.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer.kernels import registry
from deepinfer.kernels.packed_experts import PackedExperts, _dequant

from ._build import jit
from .expert_gemm_kernel import HALF, build_fp4_expert_gemm, mma_order
from .moe_combine_kernel import build_moe_combine
from .shared_expert import shared_expert

PREFILL_TOKENS = 2048  # tokens per call from which the grouped path runs (the streaming kernel wins below, H100)
# rows per tile: each expert's rows start on a multiple of this; with 64, two of an expert's tiles run as one
# 128-row tile (12.2 ms at 8K tokens against 12.5 with 128-row tiles, H100: less padding, the same MMAs)
BLOCK_M = 64


def wanted(n_tok: int, routed: PackedExperts) -> bool:
    """This path for a call of n_tok tokens: FP4 routed experts (the kernel's format; FP8 ones stream), from
    PREFILL_TOKENS tokens, outside the batch-invariant mode."""
    return routed.fmt == "fp4" and n_tok >= PREFILL_TOKENS and not registry.batch_invariant()


@functools.lru_cache(maxsize=16)
def k_perm(k: int, device) -> torch.Tensor:
    """Column j of a permuted operand holds column k_perm[j]: the wgmma fragments' order in groups of 64
    (expert_gemm_kernel.mma_order). Built once per width and device (read only): the host list's copy to a GPU
    waits for the stream, which made every prefill MoE call a device sync."""
    assert k % 64 == 0
    return (torch.arange(k // 64, device=device)[:, None] * 64
            + torch.tensor(mma_order(64), device=device)).reshape(-1)


def tilings(tile_expert: torch.Tensor | list, height: int | None = None) -> list:
    """[(tile_expert [tiles] int32, tile_row [tiles] int32 | None, height)]: groups of tiles of one height; a bare
    tile_expert is one group of `height`-row tiles (BLOCK_M by default) laid end to end (tile_row None)."""
    if isinstance(tile_expert, torch.Tensor):
        return [(tile_expert, None, height or BLOCK_M)]
    return tile_expert


def _rows_of(tile_row, height: int, n: int, device) -> torch.Tensor:
    start = tile_row.long() if tile_row is not None else torch.arange(n, device=device) * height
    return (start[:, None] + torch.arange(height, device=device)).reshape(-1)


def expert_gemm_torch(a: torch.Tensor, tiling, w: torch.Tensor, s: torch.Tensor, fmt: str,
                      aw: torch.Tensor, epilogue: str, limit: float) -> torch.Tensor:
    """The kernel's function in torch: a [rows, K] (K permuted), the tiles of `tilings(tiling)` -> [rows, N | N/2]
    (rows no tile covers: zeros)."""
    rows, k = a.shape
    n = w.shape[1]
    perm = k_perm(k, a.device)
    acc = torch.zeros(rows, n, dtype=torch.bfloat16, device=a.device)
    covered = torch.zeros(rows, dtype=torch.bool, device=a.device)
    for tile_expert, tile_row, height in tilings(tiling):
        row_idx = _rows_of(tile_row, height, tile_expert.numel(), a.device)
        expert_of_row = tile_expert.long().repeat_interleave(height)
        covered[row_idx[tile_expert.repeat_interleave(height) >= 0]] = True
        for e in [e for e in torch.unique(tile_expert).tolist() if e >= 0]:  # expert -1: an unused entry
            sel = row_idx[expert_of_row == e]
            wd = _dequant(fmt, w[e], s[e]).to(torch.bfloat16)[:, perm]
            acc[sel] = F.linear(a[sel], wd)
    if epilogue == "plain":
        return acc
    h = acc.view(rows, -1, 2, HALF)
    gate, up = h[:, :, 0].reshape(rows, -1).float(), h[:, :, 1].reshape(rows, -1).float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    act = (F.silu(gate) * up * torch.where(covered, aw, 0.0)[:, None]).to(torch.bfloat16)
    return act[:, k_perm(act.shape[1], a.device)]


def expert_gemm(a: torch.Tensor, tiling, p: PackedExperts, which: str, aw: torch.Tensor, epilogue: str,
                limit: float, height: int | None = None) -> torch.Tensor:
    """One grouped projection of `p` ("w13" or "w2") over the tiles of `a` (`tilings(tiling, height)`): the kernel
    for FP4 experts on CUDA (one launch per tile height, 64 or 128), else expert_gemm_torch."""
    w, s = (p.w13, p.s13) if which == "w13" else (p.w2, p.s2)
    groups = tilings(tiling, height)
    if p.fmt != "fp4" or not a.is_cuda:
        return expert_gemm_torch(a, groups, w, s, p.fmt, aw, epilogue, limit)
    n, k = w.shape[1], a.shape[1]
    out = torch.empty(a.shape[0], n // 2 if epilogue == "swiglu" else n, dtype=torch.bfloat16, device=a.device)
    for tile_expert, tile_row, height in groups:
        if tile_expert.numel() == 0:
            continue
        if tile_row is None:
            tile_row = torch.arange(tile_expert.numel(), dtype=torch.int32, device=a.device) * height
        # the tile height is the token side of its MMAs
        jit(build_fp4_expert_gemm, n, k, epilogue, height)(a, tile_expert, tile_row, w, s, aw, out, limit)
    return out


def combine(out: torch.Tensor, tok_rows: torch.Tensor, shared_y: torch.Tensor) -> torch.Tensor:
    """y[t] = bf16(sum_j fp32(out[tok_rows[t, j]]) + fp32(shared_y[t])), j in the order given (the kernel on CUDA)."""
    if out.is_cuda:
        y = torch.empty_like(shared_y)
        jit(build_moe_combine, out.shape[1], tok_rows.shape[1])(out, tok_rows.int().contiguous(), shared_y, y)
        return y
    y = out[tok_rows[:, 0]].float()
    for j in range(1, tok_rows.shape[1]):
        y += out[tok_rows[:, j]].float()
    return (y + shared_y.float()).to(out.dtype)


def _tile_lists(tiles: torch.Tensor, starts: torch.Tensor, assignments: int, E: int):
    """moe_experts_grouped's tilings without reading a count on the host: lists as long as a bound (every expert's
    rows end at most BLOCK_M - 1 short of a whole tile), unused entries of expert -1. With 64-row tiles, two of an
    expert's tiles run as one 128-row tile, an odd one left at 64: padding as 64-row tiles pad, the 128-token MMAs
    where an expert has the rows. Returns (tiling, the bound on the tiles, which sizes the rows)."""
    dev = tiles.device
    bound = assignments // BLOCK_M + E
    ids = torch.arange(E, dtype=torch.int32, device=dev)
    if BLOCK_M != 64:
        cum = torch.cumsum(tiles, 0)
        t = torch.arange(bound, device=dev)
        e = torch.searchsorted(cum, t, right=True)
        return torch.where(t < cum[-1], e, -1).int(), bound
    pairs, odd = tiles // 2, tiles % 2
    cum = torch.cumsum(pairs, 0)
    p = torch.arange(bound // 2 + 1, device=dev)
    e = torch.searchsorted(cum, p, right=True).clamp(max=E - 1)
    used = p < cum[-1]
    pair_row = starts[e] + 2 * BLOCK_M * (p - (cum[e] - pairs[e]))
    tiling = [(torch.where(used, e, -1).int(), torch.where(used, pair_row, 0).int(), 2 * BLOCK_M),
              (torch.where(odd > 0, ids, -1), (starts + 2 * BLOCK_M * pairs).int(), BLOCK_M)]
    return tiling, bound


def moe_experts_grouped(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, routed: PackedExperts,
                        shared: PackedExperts | None, swiglu_limit: float) -> torch.Tensor:
    """x [T, D] bf16, router weights/idx [T, k] -> [T, D] bf16 (moe_experts' contract)."""
    T_, k = idx.shape
    E, D = routed.n_experts, routed.hidden
    dev = x.device
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments by expert, tokens ascending within one
    expert = flat[order]
    ids64 = flat.long()  # (scatter_add_ takes int64 indices; the router's ids may be int32)
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, ids64, torch.ones_like(ids64))
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    starts = (torch.cumsum(tiles, 0) - tiles) * BLOCK_M
    dest = starts[expert] + torch.arange(T_ * k, device=dev) - (torch.cumsum(counts, 0) - counts)[expert]
    tiling, bound = _tile_lists(tiles, starts, T_ * k, E)
    rows = bound * BLOCK_M  # the last tiles' rows: padding, read by no used tile
    assignment = torch.full((rows,), T_ * k, dtype=torch.int64, device=dev)  # padding rows: past the end
    assignment[dest] = order
    tok = torch.where(assignment < T_ * k, assignment // k, T_)  # T_: the zero row below
    # the tokens' rows in the kernel's K order and a zero row for the padding, then copied into tile order
    xp = x.new_empty(T_ + 1, D)
    torch.index_select(x, 1, k_perm(D, dev), out=xp[:T_])
    xp[T_].zero_()
    aw = torch.cat([weights.reshape(-1).float(), weights.new_zeros(1, dtype=torch.float32)])[assignment]
    limit = float(swiglu_limit)
    act = expert_gemm(xp[tok], tiling, routed, "w13", aw, "swiglu", limit)
    out = expert_gemm(act, tiling, routed, "w2", aw, "plain", limit)  # each assignment's down projection
    # a token's experts summed in ascending expert order, then the shared expert: the reference's order
    row_of = torch.empty(T_ * k, dtype=torch.int64, device=dev)
    row_of[order] = dest
    tok_rows = row_of.view(T_, k).gather(1, torch.argsort(idx, dim=1))
    shared_y = shared_expert(x, shared, limit) if shared is not None else torch.zeros_like(x)
    return combine(out, tok_rows, shared_y)
