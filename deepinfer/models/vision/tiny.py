"""`embedded:tiny-random-vision`: the embedded test model (`embedded:tiny-random`) with a small random image path,
so an image request runs end to end on the CPU in tests and examples.

- The text side is tiny-random's, unchanged: the same config, tokenizer and weights (same seed), so a text-only
  prompt gives tiny-random's tokens exactly. The tokenizer already holds DeepSeek-V4.1's `<｜image｜>` (id 519),
  which becomes `image_token_id`; `ffn.gate.bias_vl` is part of every layer's random weights.
- The image path: a 2-layer ViT of width 64 (4 heads, SwiGLU 96, patch 14), the 3x3 aligner into the text width
  128 and the START / NEWLINE / END vectors, stored in BF16 like the release (VISION_SPEC.md §7). At most 32 span
  tokens per image (a 4 x 6 grid and its delimiters); images below 70 x 70 pixels are scaled up.
Weights are drawn from their own seeded CPU generator, so the build is deterministic.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

VISION_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    "max_image_tokens": 32,
    "min_pixels": 4900,
    "max_wh_ratio": None,
}
IMAGE_TOKEN = "<｜image｜>"
IMAGE_TOKEN_ID = 519  # the package tokenizer's id of IMAGE_TOKEN
SEED = 4127


def with_vision(text_cfg: dict) -> dict:
    """tiny-random's config.json (deepinfer.embedded.config_json()) with the image path's keys."""
    cfg = dict(text_cfg)
    cfg["image_token_id"] = IMAGE_TOKEN_ID
    cfg["vision_config"] = dict(VISION_CONFIG)
    return cfg


def vision_weights(cfg: dict) -> dict[str, torch.Tensor]:
    """Random image-path tensors under the checkpoint's names, in BF16: N(0, 1/fan_in) projections, small biases,
    norm weights around 1, unit-scale START / NEWLINE / END rows (the scale of the text embeddings)."""
    from .config import VisionConfig
    from .model import VisionModel

    model = VisionModel(VisionConfig.from_dict(cfg))
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name, p in sorted(model.named_parameters()):
        shape = tuple(p.shape)
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "vision.norm.weight":
            t = 0.6 + 0.8 * torch.rand(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        elif name.startswith("image_"):
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        out[name] = t.to(torch.bfloat16)
    return out


def add_vision_weights(out: Path, cfg: dict) -> None:
    """Adds the image path's tensors to the text checkpoint written in `out` (its model.safetensors)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(vision_weights(cfg))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
