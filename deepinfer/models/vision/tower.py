"""The vision transformer (VISION_SPEC.md §4): a linear patch embedding, pre-norm blocks of 2-D-RoPE attention and
SwiGLU, a final RMSNorm. Attention is full within each image and never crosses images.

Several images run as one batch: every matmul, norm and MLP runs over the concatenated patches of all images, and
attention is varlen over `cu_seqlens` -- on the CPU a loop over images, each one scaled_dot_product_attention
(no padding, no mask; batched equals separate runs, which the fixture checks). Parameter names are the checkpoint's
(`vision.` + these). Computed in the parameters' dtype (float32 here; the norms and the SwiGLU in fp32 always).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import NORM_EPS, VisionConfig
from .rope2d import apply_rope, rope_angles


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the statistics in fp32 whatever the activation dtype
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class PatchEmbed(nn.Module):
    """Each [3, p, p] patch flattened (channel, y, x) -> one D-vector: a Linear with bias. No CLS token, no
    absolute position embedding: positions come only from the RoPE."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(3 * cfg.patch_size ** 2, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.reshape(pixel_values.shape[0], -1).to(self.proj.weight.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # rows: the q block, then k, then v
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # varlen: each image attends only to itself
            qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, n_i, head_dim]
            out[start:end] = F.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1)
        return self.wo(out.reshape(n, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # rows: gate, then up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).float().chunk(2, dim=-1)
        return self.w2((F.silu(gate) * up).to(x.dtype))  # no clamp, unlike the text experts


class Block(nn.Module):
    """Pre-norm: h = x + attn(norm1(x)); out = h + mlp(norm2(h))."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.hidden_size), Attention(cfg)
        self.norm2, self.mlp = RMSNorm(cfg.hidden_size), SwiGLU(cfg)

    def forward(self, x, cos, sin, cu_seqlens):
        h = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return h + self.mlp(self.norm2(h))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor, num_patches: list[int]) -> torch.Tensor:
        """pixel_values [sum N_i, 3, p, p] and positions [sum N_i, 2] of the images back to back, N_i patches
        each -> vision features [sum N_i, D]."""
        if sum(num_patches) != pixel_values.shape[0]:
            raise ValueError(f"{pixel_values.shape[0]} patches for images of {num_patches} patches")
        cu_seqlens = [0]
        for n in num_patches:
            cu_seqlens.append(cu_seqlens[-1] + n)
        cos, sin = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens)
        return self.norm(x)
