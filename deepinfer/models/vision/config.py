"""The image path's settings, read from a checkpoint's config.json (VISION_SPEC.md §1).

The structure comes from `vision_config`; the constants that DeepInfer hard-codes (pixel mean/std, pad colour,
norm eps) are not config keys and live here, named once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Not in config.json (VISION_SPEC.md §1.1): DeepInfer's constants.
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
PAD_COLOUR = int(0.5 * 255)  # 127: truncated, not rounded
NORM_EPS = 1e-6


class VisionConfigError(ValueError):
    """A vision_config the image path cannot serve; the message is one line naming the key."""


@dataclass(frozen=True)
class VisionConfig:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    text_hidden_size: int  # the aligner's output width
    vocab_size: int  # the base of the engine-side span sentinels (span.py)
    image_token_id: int  # the prompt placeholder, one per image

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict) -> VisionConfig:
        vc = raw.get("vision_config")
        if not isinstance(vc, dict):
            raise VisionConfigError("config.json: no vision_config (a text-only checkpoint has no vision tower)")
        text = raw.get("text_config", raw)
        # The released config has max_wh_ratio null; DeepInfer's clamp-and-stretch path for a ratio is untested
        # here (no fixture covers it), so it is refused rather than guessed.
        if vc.get("max_wh_ratio") is not None:
            raise VisionConfigError(f"vision_config.max_wh_ratio={vc['max_wh_ratio']!r} is not supported; "
                                    "allowed: null")
        values = {k: vc.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                         "intermediate_size", "patch_size", "downsample_ratio",
                                         "max_image_tokens", "min_pixels")}
        values.update(text_hidden_size=text.get("hidden_size"), vocab_size=text.get("vocab_size"),
                      image_token_id=raw.get("image_token_id"))
        for key, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise VisionConfigError(f"config.json: {key}={value!r}; allowed: a positive integer")
        theta = vc.get("rope_theta", 10000.0)
        if not isinstance(theta, (int, float)) or theta <= 0:
            raise VisionConfigError(f"vision_config.rope_theta={theta!r}; allowed: a positive number")
        if values["hidden_size"] % values["num_attention_heads"] or (values["hidden_size"]
                                                                     // values["num_attention_heads"]) % 4:
            raise VisionConfigError(f"vision_config: hidden_size {values['hidden_size']} over "
                                    f"{values['num_attention_heads']} heads; allowed: a head dim divisible by 4 "
                                    "(2-D RoPE splits each half of the head between rows and columns)")
        if values["max_image_tokens"] < 4:
            raise VisionConfigError(f"vision_config.max_image_tokens={values['max_image_tokens']}; allowed: >= 4 "
                                    "(START, one IMAGE, NEWLINE, END)")
        return cls(rope_theta=float(theta), **values)

    @classmethod
    def from_file(cls, path: str | Path) -> VisionConfig:
        path = Path(path)
        return cls.from_dict(json.loads((path / "config.json" if path.is_dir() else path).read_text()))
