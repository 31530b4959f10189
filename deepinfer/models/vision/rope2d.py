"""The ViT's 2-D rotary embedding (VISION_SPEC.md §4.2): NeoX half-split over the whole head, the first quarter of
the channels turned by the patch row and the second by the column. Not the text model's interleaved-pair RoPE."""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, head_dim/2] for patches at (row, col) `positions` [n, 2]: angle (y*f_j, then x*f_j) with
    head_dim/4 frequencies f_j = theta^(-2j/(head_dim/2)) per axis, in fp32 on the positions' device (DeepInfer's
    VisionRotaryEmbedding builds its table on the GPU too)."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half)
    pos = positions.to(torch.float32)
    angles = torch.cat([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim]: channel c pairs with c + head_dim/2 (c < head_dim/2), rotated by angle c."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
