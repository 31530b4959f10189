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
from deepinfer.kernels.torch.quant import (dequant_fp4_rows, dequant_fp8_blocks, e8m0_to_float, fake_quant_fp4,
                                           fake_quant_fp8)
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


def fq_fp8(x: torch.Tensor) -> torch.Tensor:
    """Window KV: e4m3, ue8m0 scale per 32 channels."""
    return ste(x, fake_quant_fp8(x.detach(), 32))


def fq_fp4(x: torch.Tensor, block: int, e4m3_scales: bool) -> torch.Tensor:
    """Compressed KV (16, e4m3 scales) and indexer Q/K (32, ue8m0 scales)."""
    return ste(x, fake_quant_fp4(x.detach(), block, e4m3_scales))
