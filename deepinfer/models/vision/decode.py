"""Encoded image bytes -> an RGB Pillow image, bounded before anything large is allocated.

DeepInfer decodes with `Image.open(...).convert("RGB")` and switches Pillow's decompression-bomb check off
(VISION_SPEC.md §3.1). We keep its conversion (alpha dropped without compositing, L and P expanded; no EXIF
rotation, as DeepInfer does none) but bound the input: the byte count before opening, the pixel count from the
header before decoding, and the formats to the three a client may send.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from .errors import ImageInputError

FORMATS = ("PNG", "JPEG", "WEBP")


@dataclass(frozen=True)
class ImageLimits:
    """Per-request bounds. The defaults are ours, not DeepInfer's (it has none): 20 MiB is a large photo,
    64 MP is 8K x 8K (the processor shrinks any image to at most max_image_tokens anyway, so more pixels only
    cost decode time and memory), 16 images keeps one request's ViT work bounded."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 64 * 1024 * 1024
    max_images: int = 16


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), index: int = 0) -> Image.Image:
    """The decoded RGB image, or ImageInputError naming image `index`."""
    what = f"image {index}"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageInputError(f"{what}: {type(data).__name__} given; allowed: encoded image bytes")
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"{what}: {len(data)} bytes; allowed: at most {limits.max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb warning (above Image.MAX_IMAGE_PIXELS) becomes an error too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
            w, h = img.size
            if w * h > limits.max_pixels:
                raise ImageInputError(f"{what}: {w} x {h} = {w * h} pixels; allowed: at most "
                                      f"{limits.max_pixels} pixels")
            img.load()  # the full decode: a truncated or corrupt body fails here
            return img.convert("RGB")
    except ImageInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageInputError(f"{what}: decompression bomb (its header declares more pixels than Pillow "
                              f"decodes); allowed: at most {limits.max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise ImageInputError(f"{what}: not a readable image; allowed: {', '.join(FORMATS)}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt data
        raise ImageInputError(f"{what}: corrupt image ({e}); allowed: a complete {', '.join(FORMATS)} "
                              "file") from None
