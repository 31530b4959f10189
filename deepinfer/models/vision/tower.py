"""The vision transformer (VISION_SPEC.md §4): a linear patch embedding, pre-norm blocks of 2-D-RoPE attention and
SwiGLU, a final RMSNorm. Attention is full within each image and never crosses images.

Several images run as one batch: every matmul, norm and MLP runs over the concatenated patches of all images, and
attention is varlen over `cu_seqlens` (the `vision_attention` op kind: one scaled_dot_product_attention per image,
no padding, no mask; batched equals separate runs, which the fixture checks). The norms and the attention go
through the kernel registry (`ops`: the model's OpSet; VisionModel's default is the torch ops). Parameter names are
the checkpoint's (`vision.` + these). Computed in the parameters' dtype (float32 for the fixture, bf16 for the real
model); the norm statistics, the RoPE and the SwiGLU product in fp32 always.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from .config import NORM_EPS, VisionConfig
from .rope2d import apply_rope, rope_angles


class RMSNorm(nn.Module):
    """The registry's rms_norm: normalised in fp32, cast to the activation dtype, then times the weight (DeepInfer's
    rounding point in bf16, VISION_SPEC.md §8 #3; the same values in float32)."""

    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int], ops
                ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ops.vision_attention(q, k, v, cu_seqlens)  # varlen: each image attends only to itself
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

    def forward(self, x, cos, sin, cu_seqlens, ops):
        h = x + self.attn(self.norm1(x, ops), cos, sin, cu_seqlens, ops)
        return h + self.mlp(self.norm2(h, ops))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.ops = torch_ops()  # VisionModel.use_ops replaces it with the model's OpSet
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
            x = block(x, cos, sin, cu_seqlens, self.ops)
        return self.norm(x, self.ops)


VISION_OPS = ("rms_norm", "vision_attention")  # the op kinds the tower calls through the registry


def torch_ops() -> SimpleNamespace:
    """The torch reference ops of VISION_OPS, straight from the registry (not OpSet.build, which would also reset
    the process's batch-invariant mode)."""
    from deepinfer.kernels.registry import registered

    return SimpleNamespace(**{e.kind: e.load() for e in registered() if e.backend == "torch" and e.kind in VISION_OPS})
