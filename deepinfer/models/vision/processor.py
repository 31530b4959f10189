"""Image bytes -> ViT patches (VISION_SPEC.md §3): decode, plan the layout, resize into it with Pillow, centre on a
grey canvas, normalise, cut into patches.

Pillow does the decode and the resize: another resampler (OpenCV, torchvision) gives other pixels, and the golden
fixture stores Pillow's. The geometry comes from the decoded size, so a declared size can never disagree with it.

Two halves, as DeepInfer splits them: the host half (`ImageProcessor.resize`: decode and resize, the CPU work; the
frontend runs it once per image) gives a `ResizedImage`, the uint8 pixels and their layout; the device half
(`ResizedImage.patches`: centre, normalise, cut; tensor ops on whatever device holds the pixels) runs where the ViT
runs, like DeepInfer's `rgb_pad_to_patches`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image, ImageOps

from .config import PAD_COLOUR, PIXEL_MEAN, PIXEL_STD, VisionConfig
from .decode import ImageLimits, decode_image
from .errors import ImageInputError
from .geometry import ImageLayout, plan_image


@dataclass
class ProcessedImage:
    layout: ImageLayout
    pixel_values: torch.Tensor  # bf16 [num_patches, 3, p, p], row-major over the ViT grid
    positions: torch.Tensor  # int64 [num_patches, 2]: (row, col) of each patch, for the 2-D RoPE


@dataclass(frozen=True)
class ResizedImage:
    """An image after the host half: Pillow's resized pixels (uint8 RGB, row-major HWC, `height` x `width`, not yet
    centred or normalised) and the layout whose canvas they fit in. What the frontend hands the engine."""

    layout: ImageLayout
    width: int
    height: int
    pixels: bytes  # height * width * 3

    def rgb(self, device=None) -> torch.Tensor:
        """uint8 [height, width, 3] (a copy: the tensor owns writable memory), on `device`."""
        t = torch.frombuffer(bytearray(self.pixels), dtype=torch.uint8).view(self.height, self.width, 3)
        return t if device is None else t.to(device)

    def patches(self, patch_size: int, device=None) -> ProcessedImage:
        """The device half: centred on the canvas, normalised, cut into patches, on `device` (bitwise the same on
        any device: the normalisation is a table lookup)."""
        rgb = self.rgb(device)
        return ProcessedImage(self.layout, to_patches(rgb, self.layout, patch_size),
                              positions(self.layout, rgb.device))


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
    device = resized_rgb.device
    canvas = torch.full((layout.best_height, layout.best_width, 3), PAD_COLOUR, dtype=torch.uint8, device=device)
    left, top = pad_offsets(layout, rw, rh)
    canvas[top:top + rh, left:left + rw] = resized_rgb
    pixels = _NORMALISED.to(device)[canvas.long()].permute(2, 0, 1)  # CHW
    p = patch_size
    patches = pixels.reshape(3, layout.n_vit_h, p, layout.n_vit_w, p).permute(1, 3, 0, 2, 4)
    return patches.reshape(layout.num_patches, 3, p, p).contiguous()


def positions(layout: ImageLayout, device=None) -> torch.Tensor:
    """int64 [num_patches, 2]: (row, col) of each patch in row-major order (geometry.patch_positions), on `device`."""
    rows = torch.arange(layout.n_vit_h, device=device).repeat_interleave(layout.n_vit_w)
    cols = torch.arange(layout.n_vit_w, device=device).repeat(layout.n_vit_h)
    return torch.stack([rows, cols], dim=1)


class ImageProcessor:
    """Bytes of the images of one request -> one ProcessedImage each, bounded by `limits`."""

    def __init__(self, cfg: VisionConfig, limits: ImageLimits = ImageLimits()):
        self.cfg = cfg
        self.limits = limits

    def resized(self, img: Image.Image) -> tuple[ImageLayout, torch.Tensor]:
        """The layout of a decoded RGB image and its resized pixels (uint8 HWC, before padding)."""
        layout = plan_image(img.width, img.height, self.cfg)
        return layout, _rgb_tensor(resize_into(img, layout))

    def resize(self, img: Image.Image) -> ResizedImage:
        """The host half for a decoded RGB image: its layout and Pillow's resized pixels."""
        layout = plan_image(img.width, img.height, self.cfg)
        out = resize_into(img, layout).convert("RGB")
        return ResizedImage(layout, out.width, out.height, out.tobytes())

    def process_one(self, data: bytes, index: int = 0) -> ProcessedImage:
        """Both halves on the CPU: bytes -> patches."""
        return self.resize(decode_image(data, self.limits, index)).patches(self.cfg.patch_size)

    def __call__(self, images: list[bytes]) -> list[ProcessedImage]:
        if len(images) > self.limits.max_images:
            raise ImageInputError(f"{len(images)} images in one request; allowed: at most "
                                  f"{self.limits.max_images}")
        return [self.process_one(data, i) for i, data in enumerate(images)]


def _rgb_tensor(img: Image.Image) -> torch.Tensor:
    """uint8 [h, w, 3] from an RGB image (a copy, so the tensor owns writable memory)."""
    return torch.frombuffer(bytearray(img.convert("RGB").tobytes()), dtype=torch.uint8).reshape(
        img.height, img.width, 3)
