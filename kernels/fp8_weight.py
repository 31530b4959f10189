"""An FP8 projection weight kept as the checkpoint stores it: e4m3 codes with one ue8m0 scale per 32x32 block.

Dequantised to bf16 a projection takes 2 bytes per weight, and a decode step (memory-bound) reads every one of
them; held as stored it takes 1 + 1/1024. Both backends read this one object: the TileLang linear
(kernels/tilelang/linear.py) dequantises tiles in registers, the torch op calls `dense` (exactly the values the
loader produces when it dequantises at load, so the two model variants give identical logits on the CPU).
Pure torch: no kernel import, so the CPU path can use it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.torch.quant import dequant_fp8_blocks

BLOCK = 32  # rows and columns per ue8m0 scale (the only block size kept as stored; others are dequantised)


@dataclass(frozen=True)
class Fp8BlockWeight:
    """weight [rows, cols] e4m3 bits (uint8); scale [ceil((row_offset + rows)/32), ceil(cols/32)] ue8m0 (uint8).

    `row_offset` (0..31) is where row 0 of `weight` sits inside the first scale block: a row group of the
    grouped output projection (`row_groups`) may start mid-block when its height is not a multiple of 32 (the
    tiny test models); on the released shapes it is 0."""

    weight: torch.Tensor
    scale: torch.Tensor
    row_offset: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel()

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantised [rows, cols] matrix: e4m3 * 2^(S-127) in fp32 (exact), then cast to `dtype`."""
        w = self.weight
        if self.row_offset:  # align row 0 with its scale block (zero rows in front, dropped after)
            w = torch.cat([w.new_zeros(self.row_offset, w.shape[1]), w])
        return dequant_fp8_blocks(w.view(torch.float8_e4m3fn), self.scale)[self.row_offset:].to(dtype)

    def to(self, device) -> "Fp8BlockWeight":
        return Fp8BlockWeight(self.weight.to(device), self.scale.to(device), self.row_offset)

    def rows(self, start: int, stop: int) -> "Fp8BlockWeight":
        """Rows [start, stop) as a view (no copy): the weight rows and the scale rows that cover them."""
        first = self.row_offset + start
        last = self.row_offset + stop
        return Fp8BlockWeight(self.weight[start:stop], self.scale[first // BLOCK:-(-last // BLOCK)], first % BLOCK)

    def row_groups(self, groups: int) -> "RowGroups":
        """`groups` equal row slices: the attention output projection wo_a [groups * rank, in] is applied per
        group g to rows [g * rank, (g + 1) * rank)."""
        rank = self.shape[0] // groups
        return RowGroups([self.rows(g * rank, (g + 1) * rank) for g in range(groups)], self)


class RowGroups(list):
    """The row groups of one Fp8BlockWeight (a list of views, as the torch op indexes them) and the `whole` they
    slice, so a kernel can run every group in one launch."""

    def __init__(self, groups: list[Fp8BlockWeight], whole: Fp8BlockWeight):
        super().__init__(groups)
        self.whole = whole


def from_stored(weight: torch.Tensor, scale: torch.Tensor) -> Fp8BlockWeight:
    """Checkpoint tensors (F8_E4M3 weight, F8_E8M0 or U8 scale) -> Fp8BlockWeight over their bytes."""
    return Fp8BlockWeight(weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8))


def linear_bytes(weights) -> tuple[int, int]:
    """(bytes as held, bytes if every Fp8BlockWeight were dense bf16) over an iterable of projection weights
    (dense tensors, Fp8BlockWeights, or lists of them)."""
    held = dense = 0
    for w in weights:
        for part in (w if isinstance(w, (list, tuple)) else (w,)):
            if isinstance(part, Fp8BlockWeight):
                held += part.nbytes
                dense += part.weight.numel() * 2
            elif isinstance(part, torch.Tensor):
                held += part.numel() * part.element_size()
                dense += part.numel() * part.element_size()
    return held, dense
