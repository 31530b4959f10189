"""Registry-facing `window_kv` on window_kv_kernel.py: a decode step's window KV normalised, rotated, encoded and
written into its ring rows in one launch, bit for bit the torch op (deepinfer.kernels.torch.window_kv), which
composes rms_norm, rope, encode_fp8 and the ring's index_copy_ writes.

Kernel path: the rms_norm and rope kernel paths' conditions (rowwise.py) for a 2-D bf16 `kv` with a bf16 weight
(or none), a width that is a multiple of 128, uint8 ring parts [rows, dim] and [rows, dim / 32] and int64 write
rows on kv's device; else the torch op (a counted fallback)."""

import numpy as np
import torch

from deepinfer.kernels.registry import fall_back
from deepinfer.kernels.torch import window_kv as torch_window_kv

from ._build import dense, jit
from ._fallback import reason
from . import rowwise
from .rowwise import _ones, _rms_plan, _rope_ok
from .window_kv_kernel import BLOCK, build_window_kv

ONE_LAUNCH = 1  # 0: the separate kernels and index_copy_ writes, five launches (for A/B runs: benchmarks/with_attrs.py)


def why_not(kv, norm_weight, positions, inv_freq, ring_codes, ring_scales, write_row) -> str | None:
    """Why `window_kv` takes the torch op for these inputs, or None when the kernel runs."""
    if not (kv.is_cuda and kv.dtype == torch.bfloat16 and kv.dim() == 2 and kv.shape[0] > 0):
        return reason(kv, "kv not [tokens, dim]")
    plan = _rms_plan(kv, norm_weight)
    if plan is None or (norm_weight is not None and norm_weight.dtype != torch.bfloat16):
        return "width, row count or norm weight not covered"
    if not _rope_ok(kv, positions, inv_freq):
        return "positions or inv_freq not covered"
    n, dim = kv.shape
    for part, width in ((ring_codes, dim), (ring_scales, dim // BLOCK)):
        if not (part.dtype == torch.uint8 and part.dim() == 2 and part.shape[1] == width and part.is_contiguous()
                and part.device == kv.device):
            return "ring parts not the FP8 codec's contiguous [rows, dim] and [rows, dim / 32] bytes"
    if not (write_row.device == kv.device and write_row.shape == (n,) and write_row.dtype == torch.int64):
        return "write rows not int64 [tokens] on kv's device"
    return None


def window_kv(kv: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
              inv_freq: torch.Tensor, ring_codes: torch.Tensor, ring_scales: torch.Tensor,
              write_row: torch.Tensor) -> None:
    """Same contract as deepinfer.kernels.torch.window_kv.window_kv; one launch on the kernel path."""
    why = why_not(kv, norm_weight, positions, inv_freq, ring_codes, ring_scales, write_row)
    if why is not None:
        return fall_back("window_kv", why, torch_window_kv.window_kv, kv, norm_weight, eps, positions, inv_freq,
                         ring_codes, ring_scales, write_row)
    if not ONE_LAUNCH:
        codes, scale, _ = rowwise.encode_fp8(rowwise.rope(rowwise.rms_norm(kv, norm_weight, eps), positions, inv_freq))
        ring_codes.index_copy_(0, write_row, codes)
        ring_scales.index_copy_(0, write_row, scale)
        return None
    dim, _, lanes = _rms_plan(kv, norm_weight)
    w = _ones(dim, str(kv.device)) if norm_weight is None else dense(norm_weight)
    inv = inv_freq.to(device=kv.device, dtype=torch.float32).contiguous()
    eps32 = float(np.float32(eps))  # torch adds eps as an fp32 scalar
    jit(build_window_kv, dim, 2 * inv.numel())(dense(kv), w, positions.to(torch.int64).contiguous(), inv,
                                                ring_codes, ring_scales, write_row.contiguous(), eps32, lanes)
