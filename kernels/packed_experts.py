"""Routed/shared expert weights kept in the checkpoint's quantised format (FP4 e2m1 or FP8 e4m3), stacked once.

The released DeepSeek-V4.1-Flash experts are ~7 GB per layer in FP4 and ~27 GB once dequantised to bf16, so a GPU
holds them as stored. Both backends read this one layout: the TileLang grouped GEMM streams it and dequantises in
registers; the torch reference dequantises the experts a call touches (`PackedExperts.dense`). Pure torch: no
kernel import, so the CPU path can use it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.torch.quant import dequant_fp4_rows, dequant_fp8_blocks

BLOCK_N = 64  # rows per GEMM tile of the TileLang kernel: w1/w3 are interleaved in halves of this


@dataclass(frozen=True)
class QuantizedWeight:
    """One checkpoint weight as stored. fmt "fp4": weight [rows, cols/2] packed e2m1 (low nibble = even column),
    scale [rows, cols/32] ue8m0. fmt "fp8": weight [rows, cols] e4m3 bits, scale [rows/32, cols/32] ue8m0."""

    fmt: str
    weight: torch.Tensor  # uint8
    scale: torch.Tensor  # uint8
    shape: tuple[int, int]  # logical (rows, cols)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return _dequant(self.fmt, self.weight, self.scale).to(dtype)


def _dequant(fmt: str, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if fmt == "fp4":
        return dequant_fp4_rows(w, s)
    return dequant_fp8_blocks(w.view(torch.float8_e4m3fn), s)


@dataclass
class PackedExperts:
    """Stacked expert weights in the kernel layout. fmt "fp4": w13 [E, 2I, D/2] e2m1 pairs, s13 [E, 2I, D/32];
    w2 [E, D, I/2], s2 [E, D, I/32]. fmt "fp8": w13 [E, 2I, D] e4m3 bits, s13 [E, 2I/32, D/32]; w2 [E, D, I],
    s2 [E, D/32, I/32]. All uint8. w13 rows are tile-interleaved: each BLOCK_N rows = BLOCK_N/2 w1 rows then the
    same BLOCK_N/2 w3 rows, so one tile holds matching gate and up rows for the fused SwiGLU."""

    fmt: str
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor

    @property
    def n_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in (self.w13, self.s13, self.w2, self.s2))

    def dense(self, e: int, dtype: torch.dtype, dequant=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e dequantised: (w1 [I, D], w2 [D, I], w3 [I, D]), exactly the checkpoint's values. `dequant(w, s)`:
        another exact dequantisation of one stored matrix (a kernel's), instead of the torch one."""
        w13, w2 = self.dense_w13(e, dtype, dequant)
        w1, w3 = self.split_w13(w13)
        return w1, w2, w3

    def dense_w13(self, e: int, dtype: torch.dtype, dequant=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e dequantised as stored: (w13 [2I, D], gate and up rows interleaved, w2 [D, I])."""
        dq = dequant or (lambda w, s: _dequant(self.fmt, w, s))
        return dq(self.w13[e], self.s13[e]).to(dtype), dq(self.w2[e], self.s2[e]).to(dtype)

    @staticmethod
    def split_w13(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 [2I, D], gate and up rows interleaved in half tiles -> (w1 [I, D], w3 [I, D])."""
        t = w13.view(-1, 2, BLOCK_N // 2, w13.shape[-1])
        return t[:, 0].reshape(-1, w13.shape[-1]), t[:, 1].reshape(-1, w13.shape[-1])


def can_pack(fmt: str, inter: int, hidden: int) -> bool:
    """The interleave needs whole half-tiles of rows (and whole 32-row scale blocks for fp8)."""
    return fmt in ("fp4", "fp8") and inter % (BLOCK_N // 2) == 0 and hidden % 32 == 0


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _interleaved(gate: list[torch.Tensor], up: list[torch.Tensor], rows_per_half: int) -> torch.Tensor:
    """E x ([R, C] + [R, C]) -> [E, 2R, C]: each expert's alternating blocks of `rows_per_half` rows of gate and
    up, written into one allocation (no per-expert temporaries: a Flash layer's w13 is 4.5 GB)."""
    R, C = gate[0].shape
    out = torch.empty(len(gate), 2 * R, C, dtype=torch.uint8, device=gate[0].device)
    blocks = out.view(len(gate), R // rows_per_half, 2, rows_per_half, C)
    for e, (g, u) in enumerate(zip(gate, up)):
        blocks[e, :, 0] = _u8(g).view(R // rows_per_half, rows_per_half, C)
        blocks[e, :, 1] = _u8(u).view(R // rows_per_half, rows_per_half, C)
    return out


def pack_experts(fmt, w1, s1, w3, s3, w2, s2) -> PackedExperts:
    """Lists (one entry per expert) of checkpoint tensors -> PackedExperts. fp4: w [rows, cols/2] int8 packed
    e2m1 with scale [rows, cols/32] e8m0; fp8: w [rows, cols] e4m3 with scale [rows/32, cols/32] e8m0."""
    half = BLOCK_N // 2
    scale_half = half if fmt == "fp4" else half // 32
    return PackedExperts(fmt, _interleaved(w1, w3, half), _interleaved(s1, s3, scale_half),
                         torch.stack([_u8(w) for w in w2]), torch.stack([_u8(s) for s in s2]))


def pack_quantized(experts: list[tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight]]) -> PackedExperts:
    """(w1, w2, w3) QuantizedWeights per expert, all of one format -> PackedExperts."""
    fmt = experts[0][0].fmt
    w1, w2, w3 = zip(*experts)
    return pack_experts(fmt, [q.weight for q in w1], [q.scale for q in w1], [q.weight for q in w3],
                        [q.scale for q in w3], [q.weight for q in w2], [q.scale for q in w2])
