"""Image bytes -> ViT patches (VISION_SPEC.md §3): decode, plan the layout, resize into it with Pillow, centre on a
grey canvas, normalise, cut into patches.

Pillow does the decode and the resize: another resampler (OpenCV, torchvision) gives other pixels, and the golden
fixture stores Pillow's. The geometry comes from the decoded size, so a declared size can never disagree with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image, ImageOps

from .config import PAD_COLOUR, PIXEL_MEAN, PIXEL_STD, VisionConfig
from .decode import ImageLimits, decode_image
from .errors import ImageInputError
from .geometry import ImageLayout, patch_positions, plan_image


@dataclass
class ProcessedImage:
    layout: ImageLayout
    pixel_values: torch.Tensor  # bf16 [num_patches, 3, p, p], row-major over the ViT grid
    positions: torch.Tensor  # int64 [num_patches, 2]: (row, col) of each patch, for the 2-D RoPE


def resize_into(img: Image.Image, layout: ImageLayout) -> Image.Image:
    """The image scaled to fit the canvas, aspect kept (Pillow BICUBIC, antialiased when shrinking)."""
    size = (layout.best_width, layout.best_height)
    try:
        out = ImageOps.contain(img, size, method=Image.Resampling.BICUBIC)
        if out.width and out.height:
            return out
    except ValueError:
        pass
    # A side rounds to 0 (1 x 100000): DeepInfer catches Pillow's error and stretches to the canvas instead.
    # Pillow 13 returns an empty image rather than raising, so both are caught here.
    return img.resize(size, Image.Resampling.BICUBIC)


def pad_offsets(layout: ImageLayout, resized_w: int, resized_h: int) -> tuple[int, int]:
    """(left, top) of the resized image on the canvas: Python round, half to even (a gap of 3 gives 2, of 1
    gives 0), as DeepInfer and ImageOps.pad do."""
    return round((layout.best_width - resized_w) / 2), round((layout.best_height - resized_h) / 2)


# v -> (v/255 - mean)/std in fp32, rounded to bf16: DeepInfer's 256-entry table (its patches are bf16).
_NORMALISED = ((torch.arange(256, dtype=torch.float32) / 255 - PIXEL_MEAN) / PIXEL_STD).to(torch.bfloat16)


def to_patches(resized_rgb: torch.Tensor, layout: ImageLayout, patch_size: int) -> torch.Tensor:
    """uint8 HWC resized pixels -> bf16 [n_vit_h * n_vit_w, 3, p, p]: centred on a canvas of PAD_COLOUR,
    normalised, patches in row-major grid order, each laid out (channel, y, x)."""
    rh, rw, _ = resized_rgb.shape
    canvas = torch.full((layout.best_height, layout.best_width, 3), PAD_COLOUR, dtype=torch.uint8)
    left, top = pad_offsets(layout, rw, rh)
    canvas[top:top + rh, left:left + rw] = resized_rgb
    pixels = _NORMALISED[canvas.long()].permute(2, 0, 1)  # CHW
    p = patch_size
    patches = pixels.reshape(3, layout.n_vit_h, p, layout.n_vit_w, p).permute(1, 3, 0, 2, 4)
    return patches.reshape(layout.num_patches, 3, p, p).contiguous()


class ImageProcessor:
    """Bytes of the images of one request -> one ProcessedImage each, bounded by `limits`."""

    def __init__(self, cfg: VisionConfig, limits: ImageLimits = ImageLimits()):
        self.cfg = cfg
        self.limits = limits

    def resized(self, img: Image.Image) -> tuple[ImageLayout, torch.Tensor]:
        """The layout of a decoded RGB image and its resized pixels (uint8 HWC, before padding)."""
        layout = plan_image(img.width, img.height, self.cfg)
        return layout, _rgb_tensor(resize_into(img, layout))

    def process_one(self, data: bytes, index: int = 0) -> ProcessedImage:
        layout, rgb = self.resized(decode_image(data, self.limits, index))
        positions = torch.tensor(patch_positions(layout), dtype=torch.int64).reshape(-1, 2)
        return ProcessedImage(layout, to_patches(rgb, layout, self.cfg.patch_size), positions)

    def __call__(self, images: list[bytes]) -> list[ProcessedImage]:
        if len(images) > self.limits.max_images:
            raise ImageInputError(f"{len(images)} images in one request; allowed: at most "
                                  f"{self.limits.max_images}")
        return [self.process_one(data, i) for i, data in enumerate(images)]


def _rgb_tensor(img: Image.Image) -> torch.Tensor:
    """uint8 [h, w, 3] from an RGB image (a copy, so the tensor owns writable memory)."""
    return torch.frombuffer(bytearray(img.convert("RGB").tobytes()), dtype=torch.uint8).reshape(
        img.height, img.width, 3)
