"""Registry-facing mHC ops (`mhc_mixes`, `mhc_collapse`, `mhc_collapse_norm`, `mhc_expand`) on the TileLang kernels in
mhc_kernel.py (and collapse_norm_kernel.py).

Each keeps the torch op's signature and return dtypes. Kernel path: CUDA bf16 streams (and a bf16 layer output
for expand), fp32 pre/post/comb, widths the tiles divide; anything else goes to the torch op unchanged.

The mixes split their K loop over `_splits(T)` blocks per 64-token tile (static per compiled variant: 64 at
decode, fewer as tiles multiply), and the last of a tile's blocks to finish sums the partials and finalizes the
tile's tokens in the same launch (mhc_kernel's fused premix); the split count changes the fp32 summation order,
so a token's mixes can differ in the last bits between batch sizes. In the batch-invariant mode every token count
uses the decode split (64): the order is then fixed (partials summed in split order), at the price of more
partials at prefill sizes. At one token a call (`GEMV_TOKENS`) mhc_gemv_kernel.py's one launch over fn's columns
without the 64-token MMA tile.
"""

import numpy as np
import torch

from deepinfer.kernels.registry import batch_invariant, fall_back
from deepinfer.kernels.torch import mhc as torch_mhc

from ._build import dense as _dense
from ._build import jit, pdl_enabled
from .counters import TILE_COUNTERS, tile_counters
from ._fallback import reason
from .collapse_norm_kernel import build_mhc_collapse_norm
from .rowwise import _ones, _rms_plan, rms_norm
from .mhc_gemv_kernel import THREADS as GEMV_THREADS
from .mhc_gemv_kernel import build_mhc_mixes_gemv
from .mhc_kernel import (NOUT, build_mhc_collapse, build_mhc_expand, build_mhc_mix_finalize, build_mhc_premix,
                         mix_width)

BLOCK_T, BLOCK_K = 64, 64
SPLITS = (1, 4, 16, 64)  # K-split variants (each one compile); 320 K steps of 64 at hc*D = 20480
FILL_BLOCKS = 256        # premix blocks wanted in flight: ~2 per SM on an H200 (3 fit by shared memory)
COLLAPSE_NORM_ONE_LAUNCH = 1  # 0: mhc_collapse_norm as the collapse and rms_norm kernels (for A/B runs)
# up to this many tokens a call (outside the batch-invariant mode) the mixes take mhc_gemv_kernel's one launch over
# GEMV_SPLITS blocks of fn's columns (0: never). The op on one H100 (the 8-token build against the tiled premix):
# 8.5 / 9.4 / 11.0 / 13.8 / 15.5 us at 1 / 2 / 4 / 6 / 8 tokens against 8.4 (GEMV) / 12.1 / 12.5 / 12.6 / 12.7; the
# 40-layer step with 4 against 1, two runs an arm: B=2 12.15 / 12.41 -> 12.02 / 11.99 ms, B=4 15.17 / 15.28 ->
# 14.96 / 15.00, B=1 the same (decode_ab_s31_h100)
GEMV_TOKENS = 4
GEMV_SPLITS = 160  # 128 columns a block at hc * D = 20480: ~1.2 blocks an SM, each with 24 loads a thread in flight


def _splits(n_tok: int, k_steps: int) -> int:
    ok = [s for s in SPLITS if k_steps % s == 0]
    if batch_invariant():
        return ok[-1]
    tiles = -(-n_tok // BLOCK_T)
    return next((s for s in ok if tiles * s >= FILL_BLOCKS), ok[-1])


def _stages(splits: int, k_steps: int) -> int:
    # few steps per block (decode): put them all in flight at once; long loops: 3-deep cp.async pipeline
    steps = k_steps // splits
    return min(steps, 5) if splits >= 16 else 3


def _block_d(dim: int):
    return next((b for b in (1024, 512, 256) if dim % b == 0), None)


def _mix_io(streams, scale, base, splits: int):
    """The mixes' launch buffers: (x [n_tok, hc*D], part [splits, n_tok, NOUT], the finalize's (scale, base, pre,
    post, comb), the outputs (pre, post, comb) viewed as streams' lead dims)."""
    hc, dim = streams.shape[-2:]
    lead = streams.shape[:-2]
    x = streams.reshape(-1, hc * dim).contiguous()
    n_tok, dev = x.shape[0], x.device
    part = torch.empty(splits, n_tok, NOUT, dtype=torch.float32, device=dev)
    pre = torch.empty(n_tok, hc, dtype=torch.float32, device=dev)
    post = torch.empty(n_tok, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(n_tok, hc, hc, dtype=torch.float32, device=dev)
    mix_args = (scale.reshape(-1)[:3].float().contiguous(), base.reshape(-1).float().contiguous(), pre, post, comb)
    return x, part, mix_args, (pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc))


def mixes_with_splits(streams, fn, scale, base, hc_eps, sinkhorn_iters, norm_eps, splits: int,
                      fused: bool = True):
    """The kernel path of mhc_mixes with an explicit K-split count (tests / benchmarks); no fallback. One launch
    (the premix's last block of each token tile finalizes it) up to TILE_COUNTERS token tiles; two launches beyond,
    or with fused=False (tests compare the two: the same sums in the same order, the same bits)."""
    hc, dim = streams.shape[-2:]
    x, part, mix_args, outs = _mix_io(streams, scale, base, splits)
    n_tok, k_steps, dev = x.shape[0], hc * dim // BLOCK_K, x.device
    premix = (build_mhc_premix, hc, dim, splits, BLOCK_T, BLOCK_K, _stages(splits, k_steps))
    eps = (float(hc_eps), float(norm_eps))
    if fused and -(-n_tok // BLOCK_T) <= TILE_COUNTERS:
        jit(*premix, 128, int(sinkhorn_iters), TILE_COUNTERS)(
            x, fn.float().contiguous(), part, *mix_args, tile_counters(dev), *eps)
    else:
        jit(*premix)(x, fn.float().contiguous(), part)
        jit(build_mhc_mix_finalize, hc, dim, splits, int(sinkhorn_iters))(part, *mix_args, *eps)
    return outs


def gemv_fits(n_tok: int, hc: int, dim: int) -> bool:
    """The GEMV mixes for this call: at most GEMV_TOKENS tokens, outside the batch-invariant mode (its bits are not
    the tiled premix's), widths its blocks divide."""
    return (0 < n_tok <= GEMV_TOKENS and not batch_invariant()
            and (hc * dim) % (GEMV_SPLITS * GEMV_THREADS) == 0)


def mixes_gemv(streams, fn, scale, base, hc_eps, sinkhorn_iters, norm_eps):
    """The kernel path of mhc_mixes through mhc_gemv_kernel (one launch) for n_tok <= GEMV_TOKENS tokens."""
    hc, dim = streams.shape[-2:]
    x, part, mix_args, outs = _mix_io(streams, scale, base, GEMV_SPLITS)
    assert x.shape[0] <= GEMV_TOKENS
    # under graph capture fn is the model's, fixed: its loads may start before the kernel ahead ends
    early = pdl_enabled() and x.is_cuda and torch.cuda.is_current_stream_capturing()
    jit(build_mhc_mixes_gemv, hc, dim, GEMV_SPLITS, GEMV_TOKENS, int(sinkhorn_iters), TILE_COUNTERS,
        (hc * dim) // (GEMV_SPLITS * GEMV_THREADS), early)(
        x, fn.float().contiguous(), part, *mix_args, tile_counters(x.device), float(hc_eps), float(norm_eps))
    return outs


def mhc_mixes(streams, fn, scale, base, hc_eps, sinkhorn_iters, norm_eps):
    """Same contract as deepinfer.kernels.torch.mhc.mhc_mixes. Kernel path: CUDA bf16 streams [..., hc, D] with
    (2+hc)*hc < 32 (hc <= 4), hc*D a multiple of 64, fn [(2+hc)*hc, hc*D] on the same device; else the torch op."""
    fast = streams.is_cuda and streams.dtype == torch.bfloat16 and streams.dim() >= 2
    if fast:
        hc, dim = streams.shape[-2:]
        n = mix_width(hc)
        fast = (n < NOUT and (hc * dim) % BLOCK_K == 0 and tuple(fn.shape) == (n, hc * dim)
                and scale.numel() >= 3 and base.numel() == n and streams.numel() > 0 and int(sinkhorn_iters) >= 1
                and all(t.device == streams.device for t in (fn, scale, base)))
    if not fast:
        return fall_back("mhc_mixes", reason(streams, "streams / fn shapes not covered"), torch_mhc.mhc_mixes,
                         streams, fn, scale, base, hc_eps, sinkhorn_iters, norm_eps)
    n_tok = streams.numel() // (hc * dim)
    if gemv_fits(n_tok, hc, dim):
        return mixes_gemv(streams, fn, scale, base, hc_eps, sinkhorn_iters, norm_eps)
    return mixes_with_splits(streams, fn, scale, base, hc_eps, sinkhorn_iters, norm_eps,
                             _splits(n_tok, hc * dim // BLOCK_K))


def _collapse_ok(streams, pre) -> bool:
    """The collapse kernel's inputs: CUDA bf16 streams [..., hc, D] (D a multiple of 256), fp32 pre [..., hc]."""
    return (streams.is_cuda and streams.dtype == torch.bfloat16 and streams.dim() >= 2 and pre.dtype == torch.float32
            and pre.shape == streams.shape[:-1] and pre.device == streams.device and streams.numel() > 0
            and _block_d(streams.shape[-1]) is not None)


def mhc_collapse(streams, pre):
    """Same contract as deepinfer.kernels.torch.mhc.mhc_collapse. Kernel path: CUDA bf16 streams [..., hc, D]
    (D a multiple of 256) with fp32 pre [..., hc]; else the torch op."""
    if not _collapse_ok(streams, pre):
        return fall_back("mhc_collapse", reason(streams, "width or pre not covered"), torch_mhc.mhc_collapse,
                         streams, pre)
    hc, dim = streams.shape[-2:]
    bd = _block_d(dim)
    x = streams.reshape(-1, hc, dim).contiguous()
    out = torch.empty(x.shape[0], dim, dtype=torch.bfloat16, device=x.device)
    jit(build_mhc_collapse, hc, dim, bd, bd // 8)(x, pre.reshape(-1, hc).contiguous(), out)
    return out.view(*streams.shape[:-2], dim)


def mhc_collapse_norm(streams, pre, weight, eps):
    """Same contract as deepinfer.kernels.torch.mhc.mhc_collapse_norm. Kernel path (one launch, bit for bit the
    collapse kernel then the rms_norm kernel): mhc_collapse's conditions and rms_norm's (rowwise.py) for the
    collapsed [rows, D]; else the two ops (each its own kernel or torch op)."""
    plan = _rms_plan(streams[..., 0, :], weight) if _collapse_ok(streams, pre) else None
    if plan is None or not COLLAPSE_NORM_ONE_LAUNCH:
        return rms_norm(mhc_collapse(streams, pre), weight, eps)
    dim, rows, lanes = plan
    hc = streams.shape[-2]
    if weight is None:
        weight = _ones(dim, str(streams.device))
    kind = "fp32" if weight.dtype == torch.float32 else "bf16"
    out = torch.empty(rows, dim, dtype=weight.dtype, device=streams.device)
    jit(build_mhc_collapse_norm, hc, dim, kind)(streams.reshape(-1, hc, dim).contiguous(),
                                                pre.reshape(-1, hc).contiguous(), _dense(weight), out,
                                                float(np.float32(eps)), lanes)
    return out.view(*streams.shape[:-2], dim)


def mhc_expand(x, residual, post, comb):
    """Same contract as deepinfer.kernels.torch.mhc.mhc_expand. Kernel path: CUDA bf16 x [..., D] and residual
    [..., hc, D] (D a multiple of 256), fp32 post [..., hc] and comb [..., hc, hc]; else the torch op."""
    fast = (residual.is_cuda and residual.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
            and residual.dim() >= 2 and residual.numel() > 0 and post.dtype == torch.float32
            and comb.dtype == torch.float32 and _block_d(residual.shape[-1]) is not None)
    if fast:
        lead, (hc, dim) = residual.shape[:-2], residual.shape[-2:]
        fast = (x.shape == (*lead, dim) and post.shape == (*lead, hc) and comb.shape == (*lead, hc, hc)
                and all(t.device == residual.device for t in (x, post, comb)))
    if not fast:
        return fall_back("mhc_expand", reason(residual, "width or operands not covered"), torch_mhc.mhc_expand, x,
                         residual, post, comb)
    bd = _block_d(dim)
    res = residual.reshape(-1, hc, dim).contiguous()
    out = torch.empty_like(res)
    jit(build_mhc_expand, hc, dim, bd, bd // 8)(
        x.reshape(-1, dim).contiguous(), res, post.reshape(-1, hc).contiguous(),
        comb.reshape(-1, hc, hc).contiguous(), out)
    return out.view(residual.shape)
