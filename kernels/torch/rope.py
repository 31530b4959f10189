"""Interleaved partial RoPE: the trailing `2 * inv_freq.numel()` channels rotate as adjacent pairs."""

import math

import torch

from .elementwise import ew


def default_inv_freq(theta: float, rope_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def yarn_inv_freq(
    theta: float, rope_dim: int, factor: float, original_max: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """YaRN-blended frequencies (no magnitude scaling; attention factor 1.0)."""
    def corr_dim(rot: float) -> float:
        return (rope_dim * math.log(original_max / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
         inplace: bool = False) -> torch.Tensor:
    """x: [T, ..., n]; positions: [T] (absolute). Rotation in fp32, cast back to x's dtype. inplace: the rotated
    channels written into x, which is returned (the same values; for a temporary x, the untouched channels are not
    copied)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]
    cos, sin = ew(torch.cos, freqs).to(x.dtype), ew(torch.sin, freqs).to(x.dtype)
    if inverse:
        sin = -sin
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = inv_freq.numel() * 2
    nope, r = x[..., :-rd], x[..., -rd:]
    even, odd = r[..., 0::2].float(), r[..., 1::2].float()
    cos, sin = cos.float(), sin.float()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    if inplace:
        r.copy_(rotated)
        return x
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
