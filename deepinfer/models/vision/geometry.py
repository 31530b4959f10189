"""Where an image of W x H lands: the patch-aligned canvas, the ViT and LLM grids and the span length
(VISION_SPEC.md §3.2). Pure arithmetic; the float steps follow DeepInfer's order with Python floats, because a
different order can floor one patch lower (W*beta/p = 8.999...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import VisionConfig


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    """[START] + ([IMAGE] x w + [NEWLINE]) x h + [END]."""
    return n_llm_h * (n_llm_w + 1) + 2


@dataclass(frozen=True)
class ImageLayout:
    best_width: int  # the canvas the image is resized into and centred on
    best_height: int
    n_vit_h: int  # ViT patch grid
    n_vit_w: int
    n_llm_h: int  # LLM grid after the r x r space-to-depth
    n_llm_w: int

    @property
    def num_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def num_image_tokens(self) -> int:
        """Rows the aligner produces: one per IMAGE position of the span."""
        return self.n_llm_h * self.n_llm_w

    @property
    def num_tokens(self) -> int:
        """The whole span, START, NEWLINEs and END included."""
        return span_length(self.n_llm_h, self.n_llm_w)


def _layout(best_w: int, best_h: int, p: int, r: int) -> ImageLayout:
    n_vit_w, n_vit_h = best_w // p, best_h // p
    return ImageLayout(best_w, best_h, n_vit_h, n_vit_w, -(-n_vit_h // r), -(-n_vit_w // r))


def canvas_layout(best_width: int, best_height: int, cfg: VisionConfig) -> ImageLayout:
    """The layout of a canvas already planned (plan_image's best size): the grids follow from it alone. ValueError
    (one line) for a canvas plan_image cannot give: not whole patches, or a span over the token budget."""
    p = cfg.patch_size
    if not (best_width > 0 and best_height > 0 and best_width % p == 0 and best_height % p == 0):
        raise ValueError(f"canvas {best_width} x {best_height}; allowed: positive multiples of the patch size {p}")
    layout = _layout(best_width, best_height, p, cfg.downsample_ratio)
    if layout.num_tokens > cfg.max_image_tokens:
        raise ValueError(f"canvas {best_width} x {best_height} needs a span of {layout.num_tokens} tokens; allowed: "
                         f"at most max_image_tokens={cfg.max_image_tokens}")
    return layout


def plan_image(width: int, height: int, cfg: VisionConfig) -> ImageLayout:
    """The layout of a decoded width x height image under cfg's token budget and min_pixels."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width} x {height}; allowed: positive width and height")
    p, r, budget = cfg.patch_size, cfg.downsample_ratio, cfg.max_image_tokens
    w, h = width, height
    if 0 < w * h < cfg.min_pixels:  # small images are scaled up (int() truncates: 300x200 -> 666x444)
        # `** 0.5` as DeepInfer writes it, not math.sqrt: libm's pow is not always correctly rounded, and one ulp
        # can move int(w * s) across a patch edge (min_pixels 10609, 43 x 43: 102 here, 103 with sqrt)
        s = (cfg.min_pixels / (w * h)) ** 0.5
        w, h = int(w * s), int(h * s)
    layout = _layout(-(-w // p) * p, -(-h // p) * p, p, r)  # round up to whole patches
    if layout.num_tokens <= budget:
        return layout
    # Over budget: solve h*(w+1) = budget-2 with h = rho*w for the LLM grid, then fit the image inside it.
    rho = h / w
    w_star = math.sqrt((budget - 2) / rho + 0.25) - 0.5
    h_star = w_star * rho
    if w_star < 1:  # a single column
        best_w, best_h = r * p, ((budget - 2) // 2) * r * p
    elif h_star < 1:  # a single row
        best_w, best_h = (budget - 3) * r * p, r * p
    else:
        beta = min(math.floor(w_star) * r * p / w, math.floor(h_star) * r * p / h)
        best_w, best_h = math.floor(w * beta / p) * p, math.floor(h * beta / p) * p
    layout = _layout(best_w, best_h, p, r)
    assert layout.num_tokens <= budget, (width, height, layout)  # DeepInfer asserts the same
    return layout


def patch_positions(layout: ImageLayout) -> list[tuple[int, int]]:
    """(row, col) of each patch in row-major order: the 2-D RoPE positions (`images_global_attn_pos_id`)."""
    return [(y, x) for y in range(layout.n_vit_h) for x in range(layout.n_vit_w)]
