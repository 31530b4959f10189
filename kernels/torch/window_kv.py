"""`window_kv`: a decode step's window KV as its ring stores it, one op kind for what the layer did in five:
RMSNorm (the kv norm), RoPE, the FP8 window codec's encode, and the codes and scale bytes written into the ring
rows the step writes (CacheMeta's window write rows: a token whose row a later token of the step takes writes the
trash row). The torch backend composes its own ops, so the result is theirs bit for bit; the kernel backends do
it in one launch."""

import torch

from .cache_formats import encode_fp8
from .norm import rms_norm
from .rope import rope


def window_kv(kv: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
              inv_freq: torch.Tensor, ring_codes: torch.Tensor, ring_scales: torch.Tensor,
              write_row: torch.Tensor) -> None:
    """kv [T, D] (the wkv projection), positions [T]: ring_codes[write_row] = the e4m3 bytes [T, D] and
    ring_scales[write_row] = the ue8m0 bytes [T, D / 32] of rope(rms_norm(kv)); nothing is returned (a decode
    step reads its window back from the ring)."""
    codes, scale, _ = encode_fp8(rope(rms_norm(kv, norm_weight, eps), positions, inv_freq))
    ring_codes.index_copy_(0, write_row, codes)
    ring_scales.index_copy_(0, write_row, scale)
