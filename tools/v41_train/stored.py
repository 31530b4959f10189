"""Straight-through fake quantisation for training (MODEL_V41_SPEC.md §4.10, §8.3).

Two kinds, both "forward = what inference computes, backward = identity":
  - weights: the forward uses exactly the value the exported checkpoint will hold after the loader dequantises it
    (the embedded writer's FP8 32x32 blocks / FP4 rows / FP8 Engram rows, BF16 for plain tensors, F32 where the
    release keeps F32). So the trained model *is* the exported model, not an approximation of it.
  - activations: the inference model's own in-forward quantisers (window KV FP8, compressed KV FP4 e4m3/16,
    indexer Q/K FP4 ue8m0/32), from deepinfer.kernels.torch.quant.
"""

from __future__ import annotations

import torch

from deepinfer.embedded import quantize_fp4_rows, quantize_fp8_blocks, quantize_fp8_rows
from deepinfer.kernels.torch.quant import (FP4_MAX, FP8_MAX, ceil_pow2, dequant_fp4_rows, dequant_fp8_blocks,
                                           e2m1_codes, e2m1_values, e8m0_to_float, fake_quant_fp4, fake_quant_fp8)
from deepinfer.models.loading import tensors as kinds
from deepinfer.models.loading.names import keeps_float32


def ste(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` in the forward, the gradient of `x` in the backward."""
    return x + (value - x).detach()


@torch.no_grad()
def stored_value(name: str, spec: kinds.Spec, w: torch.Tensor) -> torch.Tensor:
    """The fp32 value the loader reads back for tensor `name` written from `w` by embedded.release_tensors."""
    w = w.float()
    if kinds.FP4_ROWS in spec.allowed:
        return dequant_fp4_rows(*quantize_fp4_rows(w))
    if kinds.FP8_BLOCK in spec.allowed:
        return dequant_fp8_blocks(*quantize_fp8_blocks(w))
    if kinds.FP8_ROWS in spec.allowed:
        q, s = quantize_fp8_rows(w)
        return q.float() * e8m0_to_float(s).repeat_interleave(32, 1)
    return w if keeps_float32(name) else w.to(torch.bfloat16).float()


def quantized_weight(name: str, spec: kinds.Spec, w: torch.Tensor) -> torch.Tensor:
    return ste(w, stored_value(name, spec, w))


def storage_kind(name: str, spec: kinds.Spec) -> str:
    for kind in (kinds.FP4_ROWS, kinds.FP8_BLOCK, kinds.FP8_ROWS):
        if kind in spec.allowed:
            return kind
    return "f32" if keeps_float32(name) else "bf16"


@torch.no_grad()
def stored_values(kind: str, w: torch.Tensor) -> torch.Tensor:
    """`stored_value` for a stack [n, rows, cols] of same-kind tensors in one pass (a training step would
    otherwise spend most of its kernel launches quantising hundreds of small weights one by one). The same
    arithmetic as the writer + loader: a power-of-two scale ceil_pow2(amax / max) per block (1 for an all-zero
    block), the value divided by it, rounded to the format, multiplied back."""
    w = w.float()
    if kind == "f32":
        return w
    if kind == "bf16":
        return w.to(torch.bfloat16).float()
    n, rows, cols = w.shape
    if kind == kinds.FP8_BLOCK:
        pr, pc = -rows % 32, -cols % 32
        blocks = torch.nn.functional.pad(w, (0, pc, 0, pr)).view(n, (rows + pr) // 32, 32, (cols + pc) // 32, 32)
        scale = _pow2(blocks.abs().amax(dim=(2, 4), keepdim=True), FP8_MAX)
        q = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
        return q.view(n, rows + pr, cols + pc)[:, :rows, :cols]
    blocks = w.view(n, rows, cols // 32, 32)
    if kind == kinds.FP8_ROWS:
        scale = _pow2(blocks.abs().amax(-1, keepdim=True), FP8_MAX)
        return ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).view(n, rows, cols)
    scale = _pow2(blocks.abs().amax(-1, keepdim=True), FP4_MAX)
    return (e2m1_values(e2m1_codes((blocks / scale).clamp(-FP4_MAX, FP4_MAX))) * scale).view(n, rows, cols)


def _pow2(amax: torch.Tensor, top: float) -> torch.Tensor:
    return torch.where(amax > 0, ceil_pow2(amax.clamp_min(1e-30) / top), torch.ones_like(amax))


def fq_fp8(x: torch.Tensor) -> torch.Tensor:
    """Window KV: e4m3, ue8m0 scale per 32 channels."""
    return ste(x, fake_quant_fp8(x.detach(), 32))


def fq_fp4(x: torch.Tensor, block: int, e4m3_scales: bool) -> torch.Tensor:
    """Compressed KV (16, e4m3 scales) and indexer Q/K (32, ue8m0 scales)."""
    return ste(x, fake_quant_fp4(x.detach(), block, e4m3_scales))
