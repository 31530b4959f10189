"""FP8 / FP4 fake quantization (the model's in-forward QAT quantizers) and checkpoint dequantization."""

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_LUT = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)
# Rounding boundaries between grid points; at a tie the even code wins, so ties at odd-code
# boundaries (0.75, 1.75, 3.5) round up and ties at even-code boundaries round down.
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIES_UP = torch.tensor([False, True, False, True, False, True, False])
_ON_DEVICE: dict = {}


def _on(device, name: str, table: torch.Tensor) -> torch.Tensor:
    """A constant table on `device`, copied once: a copy per call would be a host-to-device transfer inside every
    step (and is not allowed while a CUDA graph is being captured)."""
    key = (str(device), name)
    t = _ON_DEVICE.get(key)
    if t is None:
        t = _ON_DEVICE[key] = table.to(device)
    return t


def ceil_pow2(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) for fp32 t > 0, exactly, from the IEEE bit pattern (ue8m0 scale rounding)."""
    bits = t.float().contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(k.to(torch.float32))


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already within ±6) to e2m1 codes, ties to even; sign in bit 3."""
    bounds = _on(q.device, "bounds", _BOUNDS)
    ties_up = _on(q.device, "ties_up", _TIES_UP)
    thresholds = torch.where(ties_up, bounds, torch.nextafter(bounds, torch.full_like(bounds, 7.0)))
    codes = (q.abs().unsqueeze(-1) >= thresholds).sum(-1).to(torch.uint8)
    return codes | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    return _on(codes.device, "lut", _LUT)[codes.long() & 15]


def fake_quant_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e4m3 with a ue8m0 (power-of-two) scale per `block` channels; widths not divisible pass through."""
    n = x.shape[-1]
    if n % block:
        return x
    blocks = x.float().view(*x.shape[:-1], n // block, block)
    scale = ceil_pow2(blocks.abs().amax(-1).clamp_min(1e-4) * (1.0 / FP8_MAX)).unsqueeze(-1)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).view(x.shape).to(x.dtype)


def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool = False) -> torch.Tensor:
    """e2m1 with one scale per `block` channels: ue8m0 (indexer, block 32) or e4m3 (compressed KV, 16)."""
    n = x.shape[-1]
    if n % block:
        return x
    blocks = x.float().view(*x.shape[:-1], n // block, block)
    amax = blocks.abs().amax(-1)
    if e4m3_scales:
        scale = (amax.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = ceil_pow2(amax.clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
    scale = scale.unsqueeze(-1)
    values = e2m1_values(e2m1_codes((blocks / scale).clamp(-FP4_MAX, FP4_MAX)))
    return (values * scale).view(x.shape).to(x.dtype)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 byte b -> 2^(b-127) (float8_e8m0fnu or uint8 storage)."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    return torch.exp2(scale.to(torch.float32) - 127.0)


def dequant_fp8_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """W[r, c] = e4m3(w[r, c]) * 2^(S[r // 32, c // 32] - 127)."""
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    return w.float() * s


def dequant_fp4_rows(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Packed e2m1 (low nibble = even column) with a ue8m0 scale per row and `block` columns."""
    b = packed.view(torch.uint8)
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)
    s = e8m0_to_float(scale).repeat_interleave(block, 1)[:, : codes.shape[1]]
    return e2m1_values(codes) * s
