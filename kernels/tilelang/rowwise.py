"""Registry-facing `rms_norm`, `rope`, `fake_quant_fp8`, `fake_quant_fp4`, `encode_fp8` and `encode_fp4` on the
one-launch kernels of rowwise_kernel.py (each torch op is ~5-20 launches). Same signatures and results as
deepinfer.kernels.torch (norm / rope / quant / cache_formats), bit for bit for bf16 on CUDA; anything a kernel
does not cover goes to the torch op.

Kernel paths (all need a CUDA bf16 `x`; non-contiguous inputs are made contiguous first):
* rms_norm: last dim a multiple of 128 with a configuration ATen reduces in one warp or block per row (every
  width up to 7680, see torch_reduce_lanes); weight None, bf16 or fp32 of shape [dim].
* rope: x [T, ..., dim] with integer positions [T] on x's device, 2 * len(inv_freq) a multiple of 8, dim a
  multiple of 8; inv_freq fp32 / bf16 / fp16 (the torch op promotes it to fp32 too). In place on a contiguous x
  (`inplace=True`) the launch reads and writes only the rotated channels.
* fake_quant_fp8 / fake_quant_fp4: `block` a multiple of 8 with block / 8 a power of two <= 32.
* encode_fp8: the FP8 window codec's block of 32 (the fake_quant_fp8 kernel also writing the codes and scales).
* encode_fp4: fake_quant_fp4's blocks, writing the e2m1 pairs and scale bytes (not the values).
RMSNorm's statistic follows ATen's summation order for its [rows, dim] launch (the lane count depends on the row
count below 16 rows), so, like the torch op, a row's result can depend on how many rows are normalised together;
the batch-invariant mode uses the 16-row lane count for every row count.
"""

import functools

import numpy as np
import torch

from deepinfer.kernels.registry import batch_invariant, fall_back
from deepinfer.kernels.torch import norm as torch_norm
from deepinfer.kernels.torch import cache_formats as torch_formats
from deepinfer.kernels.torch import quant as torch_quant
from deepinfer.kernels.torch import rope as torch_rope

from ._build import dense as _dense
from ._build import jit, precompile  # noqa: F401 (precompile: warm-up with kernels_for's jobs)
from ._fallback import reason
from .rowwise_kernel import build_fake_quant, build_rms_norm_block, build_rms_norm_warp, build_rope, last_pow2

_MAX_REDUCE_THREADS = 512  # Reduce.cuh mnt_wrapper<float>::MAX_NUM_THREADS
_WARP = 32


def torch_reduce_lanes(dim: int, rows: int) -> int | None:
    """Lanes per row ATen's CUDA reduction uses for `x.float().pow(2).mean(-1)` over a contiguous [rows, dim]
    tensor (Reduce.cuh `setReduceConfig`: input vectorised 4-wide from dim 128 up), or None for what the kernels
    do not emulate (unvectorised widths, a vector tail, a row split across warps or blocks)."""
    if dim < 128 or dim % 4 or rows < 1:
        return None
    dim0 = dim // 4
    d0 = last_pow2(dim0) if dim0 < _MAX_REDUCE_THREADS else _MAX_REDUCE_THREADS
    d1 = last_pow2(rows) if rows < _MAX_REDUCE_THREADS else _MAX_REDUCE_THREADS
    width = min(d0, _WARP)
    height = min(d1, _MAX_REDUCE_THREADS // width)
    width = min(d0, _MAX_REDUCE_THREADS // height)
    if -(-dim // width) >= min(height * 16, 256):  # split_across_warps: block_y / global reduce
        return None
    return width


@functools.lru_cache(maxsize=32)
def _ones(dim: int, device: str) -> torch.Tensor:
    return torch.ones(dim, dtype=torch.bfloat16, device=device)


def _rms_plan(x: torch.Tensor, weight: torch.Tensor | None):
    """(dim, rows, lanes) when the kernel path applies, else None."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() >= 1 and x.numel() > 0):
        return None
    dim = x.shape[-1]
    if dim % 128:
        return None
    if weight is not None and not (weight.is_cuda and weight.device == x.device and weight.dim() == 1
                                   and weight.shape[0] == dim and weight.dtype in (torch.bfloat16, torch.float32)):
        return None
    rows = x.numel() // dim
    # batch-invariant mode: the lane count ATen uses from 16 rows up, whatever the row count (below 16 it follows
    # the rows, and with it a row's summation order)
    lanes = torch_reduce_lanes(dim, max(rows, 16) if batch_invariant() else rows)
    if lanes is None:
        return None
    return dim, rows, lanes


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.norm.rms_norm; one launch on the kernel path (module docstring)."""
    plan = _rms_plan(x, weight)
    if plan is None:
        return fall_back("rms_norm", reason(x, "width, row count or weight not covered"), torch_norm.rms_norm, x,
                         weight, eps)
    dim, rows, lanes = plan
    if weight is None:
        weight = _ones(dim, str(x.device))  # bf16(1 * y) == y
    kind = "fp32" if weight.dtype == torch.float32 else "bf16"
    x2, w = _dense(x.reshape(rows, dim)), _dense(weight)
    out = torch.empty(rows, dim, dtype=weight.dtype, device=x.device)
    eps32 = float(np.float32(eps))  # torch adds eps as an fp32 scalar
    if lanes == _WARP:
        jit(build_rms_norm_warp, dim, kind)(x2, w, out, eps32)
    else:
        jit(build_rms_norm_block, dim, kind)(x2, w, out, eps32, lanes)
    return out.view(x.shape)


def _rope_ok(x, positions, inv_freq) -> bool:
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() >= 2 and x.numel() > 0):
        return False
    if not (positions.dim() == 1 and positions.shape[0] == x.shape[0] and positions.device == x.device
            and not positions.is_floating_point() and not positions.is_complex() and positions.dtype != torch.bool):
        return False
    if not (inv_freq.dim() == 1 and inv_freq.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return False
    rd, dim = 2 * inv_freq.numel(), x.shape[-1]
    return rd > 0 and rd % 8 == 0 and dim % 8 == 0 and rd <= dim


# a rope launch visiting fewer 16-byte chunks than this gives each thread one chunk instead of four (the same bits):
# at decode a query's 64 heads x 8 rotated chunks are one block of 128 threads at four, each thread evaluating 32
# cos / sin in turn (~7 us a call at B=1, 96 calls a step, decode_gpu_flash40_nopdl_s27_h100). The 40-layer step at
# B=1 ran 10.60 -> 9.91 ms with it, B=8 21.56 -> 20.62 ms (one H100, two runs an arm, decode_ab_s30_h100; 0: never)
ROPE_ONE_CHUNK_BELOW = 65536


def _rope_per(chunks: int) -> int:
    return 1 if chunks < ROPE_ONE_CHUNK_BELOW else 4


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
         inplace: bool = False) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.rope.rope; one launch on the kernel path (module docstring). In
    place on a contiguous x the launch visits only the rotated channels."""
    if not _rope_ok(x, positions, inv_freq):
        return fall_back("rope", reason(x, "width, positions or inv_freq not covered"), torch_rope.rope, x,
                         positions, inv_freq, inverse, inplace)
    dim, rd = x.shape[-1], 2 * inv_freq.numel()
    heads = x.numel() // (x.shape[0] * dim)
    pos = positions.to(torch.int64).contiguous()
    inv = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    if inplace and x.is_contiguous():
        x2 = x.view(-1, dim)
        jit(build_rope, dim, rd, bool(inverse), 128, _rope_per(x2.shape[0] * rd // 8), True)(x2, pos, inv, x2, heads)
        return x
    x2 = _dense(x.reshape(-1, dim))
    out = torch.empty_like(x2)
    per = _rope_per(x2.shape[0] * dim // 8)
    spec = (dim, rd, bool(inverse)) + (() if per == 4 else (128, per, False))  # (the manifest's spec at four)
    jit(build_rope, *spec)(x2, pos, inv, out, heads)
    if inplace:  # a strided x: rotated out of place, then written back
        return x.copy_(out.view(x.shape))
    return out.view(x.shape)


def _quant_ok(x, block) -> bool:
    g = block // 8 if isinstance(block, int) else 0
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() >= 1 and x.numel() > 0 and block % 8 == 0
            and 0 < g <= 32 and g & (g - 1) == 0 and x.shape[-1] % block == 0)


def _fake_quant(x: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    x2 = _dense(x).view(-1, 8)
    out = torch.empty_like(x2)
    jit(build_fake_quant, kind, block)(x2, out)
    return out.view(x.shape)


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.quant.fake_quant_fp8 (widths not divisible by `block` pass
    through as the same tensor); one launch on the kernel path (module docstring)."""
    if not _quant_ok(x, block):
        return fall_back("fake_quant_fp8", reason(x, "block or width not covered"), torch_quant.fake_quant_fp8, x,
                         block)
    return _fake_quant(x, "fp8", block)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """Same contract as deepinfer.kernels.torch.quant.fake_quant_fp4; one launch on the kernel path (module
    docstring)."""
    if not _quant_ok(x, block):
        return fall_back("fake_quant_fp4", reason(x, "block or width not covered"), torch_quant.fake_quant_fp4, x,
                         block, e4m3_scales)
    return _fake_quant(x, "fp4_e4m3" if e4m3_scales else "fp4_ue8m0", block)


def encode_fp8(x: torch.Tensor):
    """Same contract as deepinfer.kernels.torch.cache_formats.encode_fp8 (codes, scale bytes, decoded values);
    one launch on the kernel path instead of the codec's ~20 torch ops."""
    if not _quant_ok(x, 32):
        return fall_back("encode_fp8", reason(x, "width not covered"), torch_formats.encode_fp8, x)
    x2 = _dense(x).view(-1, 8)
    out = torch.empty_like(x2)
    codes = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0] // 4, dtype=torch.uint8, device=x.device)
    jit(build_fake_quant, "fp8", 32, 256, 2, True)(x2, out, codes, scale)
    return codes.view(x.shape), scale.view(*x.shape[:-1], x.shape[-1] // 32), out.view(x.shape)


def encode_fp4(x: torch.Tensor, block: int, e4m3_scales: bool):
    """Same contract as deepinfer.kernels.torch.cache_formats.encode_fp4 (e2m1 pairs, scale bytes); one launch
    on the kernel path instead of the codec's ~15 torch ops."""
    if not _quant_ok(x, block):
        return fall_back("encode_fp4", reason(x, "block or width not covered"), torch_formats.encode_fp4, x, block,
                         e4m3_scales)
    x2 = _dense(x).view(-1, 8)
    codes = torch.empty(x2.shape[0], 4, dtype=torch.uint8, device=x.device)
    scale = torch.empty(x2.shape[0] * 8 // block, dtype=torch.uint8, device=x.device)
    jit(build_fake_quant, "fp4_e4m3" if e4m3_scales else "fp4_ue8m0", block, 256, 2, True)(x2, codes, scale)
    return codes.view(*x.shape[:-1], x.shape[-1] // 2), scale.view(*x.shape[:-1], x.shape[-1] // block)


# ---------------------------------------------------------------------------------------------- warm-up
def kernels_for(*, norm_dims=(), rope_shapes=(), quant=()) -> list[tuple]:
    """The (builder, *static args) keys the ops above compile for the given widths: norm_dims [(dim, weight dtype
    or None)], rope_shapes [(dim, rope_dim, inverse)], quant [(kind, block)] with kind fp8 / fp4_ue8m0 /
    fp4_e4m3. Norms get both variants (one warp per row for >= 16 rows, one block per row below)."""
    jobs = []
    for dim, wdt in norm_dims:
        kind = "fp32" if wdt == torch.float32 else "bf16"
        jobs.append((build_rms_norm_warp, dim, kind))
        if last_pow2(dim // 4) >= 64:
            jobs.append((build_rms_norm_block, dim, kind))
    jobs += [(build_rope, dim, rd, bool(inv)) for dim, rd, inv in rope_shapes]
    jobs += [(build_fake_quant, kind, block) for kind, block in quant]
    return jobs
