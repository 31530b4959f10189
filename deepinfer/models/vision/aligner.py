"""From ViT features to LLM rows (VISION_SPEC.md §5): a 3x3 space-to-depth ("unshuffle") of each image's feature
grid, then Linear-GELU-Linear into the text width. One output row per IMAGE token, in reading order."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig


def unshuffle(features: torch.Tensor, n_vit_h: int, n_vit_w: int, r: int) -> torch.Tensor:
    """One image's features [n_vit_h*n_vit_w, D] -> [n_llm_h*n_llm_w, r*r*D]. The grid is zero-padded at the
    bottom and right to multiples of r (padded cells add zeros, not means); each r x r window, in row-major
    order, becomes one vector whose element c*r*r + r*i + j is channel c at window row i, column j (channel-major,
    as F.unfold lays it out)."""
    d = features.shape[-1]
    grid = features.reshape(n_vit_h, n_vit_w, d).permute(2, 0, 1)  # [D, h, w]
    grid = F.pad(grid, (0, -n_vit_w % r, 0, -n_vit_h % r))
    hh, ww = grid.shape[1] // r, grid.shape[2] // r
    windows = grid.reshape(d, hh, r, ww, r).permute(1, 3, 0, 2, 4)  # [hh, ww, D, i, j]
    return windows.reshape(hh * ww, d * r * r)


class Aligner(nn.Module):
    """`downsample_mlp_gelu` of depth 2: w2(gelu(w1(u))), GELU in its exact erf form."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.downsample_ratio ** 2 * cfg.hidden_size, cfg.text_hidden_size)
        self.w2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size)

    def forward(self, unshuffled: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(unshuffled)))
