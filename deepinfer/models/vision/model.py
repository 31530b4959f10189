"""The image path's parameters in one module, named as the checkpoint names them (`vision.*`, `aligner.*`,
`image_start/end/newline`), and the one call the engine makes: images -> span rows per image, on the module's
device (the patches of a ResizedImage are made there)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .aligner import Aligner, unshuffle
from .config import VisionConfig
from .processor import ProcessedImage, ResizedImage
from .span import span_rows
from .tower import VisionTransformer


class VisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg)
        self.aligner = Aligner(cfg)
        # learned delimiters of the span (VISION_SPEC.md §6.2)
        self.image_start = nn.Parameter(torch.zeros(cfg.text_hidden_size))
        self.image_end = nn.Parameter(torch.zeros(cfg.text_hidden_size))
        self.image_newline = nn.Parameter(torch.zeros(cfg.text_hidden_size))

    def image_embeds(self, features: torch.Tensor, images: Sequence[ProcessedImage]) -> list[torch.Tensor]:
        """Features of the images back to back -> per image its aligner rows [n_llm_h * n_llm_w, text width]."""
        r = self.cfg.downsample_ratio
        per_image = features.split([im.layout.num_patches for im in images])
        return [self.aligner(unshuffle(f, im.layout.n_vit_h, im.layout.n_vit_w, r))
                for f, im in zip(per_image, images)]

    def use_ops(self, ops) -> VisionModel:
        """Run the tower's op kinds (tower.VISION_OPS) on `ops`, the text model's OpSet (the default: torch ops)."""
        self.vision.ops = ops
        return self

    @torch.inference_mode()
    def forward(self, images: Sequence[ProcessedImage | ResizedImage]) -> list[torch.Tensor]:
        """Each image's span rows [num_tokens, text width], the ViT run once over all images (varlen). A
        ResizedImage is centred, normalised and cut into patches on this module's device first."""
        if not images:
            return []
        device = self.image_start.device
        images = [im.patches(self.cfg.patch_size, device) if isinstance(im, ResizedImage) else im for im in images]
        features = self.vision(torch.cat([im.pixel_values for im in images]).to(device),
                               torch.cat([im.positions for im in images]).to(device),
                               [im.layout.num_patches for im in images])
        return [span_rows(e, im.layout, self.image_start, self.image_newline, self.image_end)
                for e, im in zip(self.image_embeds(features, images), images)]
