"""Storage formats of the cache pools (MODEL_V41_SPEC.md §5.2): what a cached row is stored as, and back.

The model fake-quantises what it caches (window KV to FP8, compressed KV and indexer keys to FP4, §4.10), so
storing the codes and scales loses nothing: `decode(encode(x))` is bitwise the fake-quantised `x`. A width the
quantiser skips (not a multiple of its block) is stored raw, in the model dtype, as the quantiser leaves it.

A codec's `parts(width)` lists the tensors one row is stored as (trailing shape, dtype), in the order `encode`
returns them and `decode` takes them; the decode kernels read the same byte layouts:
  fp8  : e4m3 bytes [width] + ue8m0 exponent bytes [width / 32]
  fp4  : e2m1 pairs [width / 2] (low nibble = even channel) + one scale byte per block (ue8m0 or e4m3)
"""

from __future__ import annotations

import torch

from .quant import FP4_MAX, FP8_MAX, _on, e2m1_codes, e2m1_values

_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # byte -> value (NaN codes too)
# byte -> (value of the low nibble, value of the high nibble): an FP4 pair decoded with one gather
_E2M1_PAIRS = torch.stack([e2m1_values(torch.arange(256) & 15), e2m1_values(torch.arange(256) >> 4)], dim=-1)


def _exponent_byte(t: torch.Tensor) -> torch.Tensor:
    """ue8m0 byte of ceil_pow2(t) for fp32 t > 0: the scale fake_quant uses, as 127 + log2."""
    bits = t.float().contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return k.to(torch.uint8)


def _exp2_byte(b: torch.Tensor) -> torch.Tensor:
    return torch.exp2(b.to(torch.float32) - 127.0)


class RawCodec:
    name = "raw"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def parts(self, width: int):
        return [((width,), self.dtype)]

    def encode(self, x: torch.Tensor):
        return (x.to(self.dtype),)

    def decode(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return data.to(dtype)


class Fp8Codec:
    """e4m3 with a ue8m0 scale per 32 channels (the window KV)."""

    name = "fp8_e4m3_ue8m0"
    block = 32

    def parts(self, width: int):
        return [((width,), torch.uint8), ((width // self.block,), torch.uint8)]

    def encode(self, x: torch.Tensor):
        blocks = x.float().unflatten(-1, (-1, self.block))
        byte = _exponent_byte(blocks.abs().amax(-1).clamp_min(1e-4) * (1.0 / FP8_MAX))
        q = (blocks / _exp2_byte(byte).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8).flatten(-2), byte

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # a 256-entry table gathered with int32 ids: ~6x faster than torch's e4m3 -> fp32 conversion on the CPU
        table = _on(codes.device, "e4m3", _E4M3)
        v = torch.index_select(table, 0, codes.int().flatten()).view(codes.shape).unflatten(-1, (-1, self.block))
        return (v * _exp2_byte(scale).unsqueeze(-1)).flatten(-2).to(dtype)


class Fp4Codec:
    """e2m1 with one scale per `block` channels: ue8m0 (indexer keys, block 32) or e4m3 (compressed KV, 16)."""

    def __init__(self, block: int, e4m3_scales: bool):
        self.block, self.e4m3_scales = block, e4m3_scales
        self.name = f"fp4_e2m1_{'e4m3' if e4m3_scales else 'ue8m0'}{block}"

    def parts(self, width: int):
        return [((width // 2,), torch.uint8), ((width // self.block,), torch.uint8)]

    def encode(self, x: torch.Tensor):
        blocks = x.float().unflatten(-1, (-1, self.block))
        amax = blocks.abs().amax(-1)
        if self.e4m3_scales:
            s8 = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn)
            scale, byte = s8.float(), s8.view(torch.uint8)
        else:
            byte = _exponent_byte(amax.clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
            scale = _exp2_byte(byte)
        codes = e2m1_codes((blocks / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
        return codes[..., 0::2] | (codes[..., 1::2] << 4), byte

    def decode(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # [..., width / 2, 2]: one lookup a byte (index_select with int32 ids: several times faster than [] indexing)
        table = _on(packed.device, "e2m1_pairs", _E2M1_PAIRS)
        pairs = torch.index_select(table, 0, packed.int().flatten()).view(*packed.shape, 2)
        s = scale.view(torch.float8_e4m3fn).float() if self.e4m3_scales else _exp2_byte(scale)
        v = pairs.flatten(-2).unflatten(-1, (-1, self.block)) * s.unsqueeze(-1)
        return v.flatten(-2).to(dtype)


def encode_fp8(x: torch.Tensor):
    """The FP8 window codec's parts of x [..., D] (D a multiple of 32): e4m3 bytes [..., D] and ue8m0 bytes
    [..., D / 32], then what they decode to in x's dtype (the fake-quantised x). Fp8Codec's encode and decode as
    one op kind, which the kernel backends do in one launch."""
    codec = Fp8Codec()
    codes, scale = codec.encode(x)
    return codes, scale, codec.decode(codes, scale, x.dtype)


def encode_fp4(x: torch.Tensor, block: int, e4m3_scales: bool):
    """The FP4 codec's parts of x [..., D] (D a multiple of `block`): e2m1 pairs [..., D / 2] and one scale byte
    per block [..., D / block] (e4m3 or ue8m0), as Fp4Codec(block, e4m3_scales) encodes them: the compressed KV
    (16, e4m3) and the indexer keys (32, ue8m0) as one op kind, which the kernel backends do in one launch."""
    return Fp4Codec(block, e4m3_scales).encode(x)


def window_codec(width: int, dtype: torch.dtype):
    return Fp8Codec() if width % Fp8Codec.block == 0 else RawCodec(dtype)


def compressed_codec(width: int, dtype: torch.dtype):
    return Fp4Codec(16, True) if width % 16 == 0 else RawCodec(dtype)


def index_key_codec(width: int, dtype: torch.dtype):
    return Fp4Codec(32, False) if width % 32 == 0 else RawCodec(dtype)


def row_bytes(codec, width: int) -> int:
    return sum(int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size() for shape, dt in codec.parts(width))
