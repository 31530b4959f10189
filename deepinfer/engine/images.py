"""Image input in the engine core (VISION_SPEC.md §6, docs/vision.md).

- On arrival (`prepare_images`, EngineCore.add_request): no pixel work (the frontend decoded and resized each image
  once); each ImageInput is checked against the model and the prompt: a canvas the model's geometry can give, the
  pixels fitting it, a span length that is the canvas's and span ids that are DeepInfer's (vocab+2, then
  vocab+1s). The request keeps the resized pixels (PromptImage) for its whole life, so a recompute after
  preemption has them again.
- At prefill (`SpanRowCache`, the ModelRunner): when a step's new tokens first reach an image span, the pixels of
  every such image of the step go to the device, are centred, normalised and cut into patches there, and the ViT
  and the aligner run once over all of them (varlen over images); the span's rows are kept until the prefill has
  passed the span; each step takes the rows of the span positions it covers, so a chunk may start or end anywhere
  inside a span.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.messages import ImageInput


@dataclass(frozen=True)
class PromptImage:
    start: int  # the span's first position in the prompt
    length: int  # span tokens
    image: Any  # deepinfer.models.vision.processor.ResizedImage: the layout and the resized pixels

    @property
    def end(self) -> int:
        return self.start + self.length


def prepare_images(images: list[ImageInput], prompt_ids: list[int], vision, vocab_size: int) -> list[PromptImage]:
    """The request's images checked against the model and its prompt; ValueError (one line) for what cannot run.
    `vision`: the model's VisionModel (None: the checkpoint has no image path)."""
    if not images:
        return []
    if vision is None:
        raise ValueError("this model has no vision tower (no vision_config, or no vision.* / aligner.* tensors in "
                         "its checkpoint); allowed: text-only prompts")
    from deepinfer.models.vision import ImageLimits
    from deepinfer.models.vision.span import IMAGE_ID_OFFSET, PAD_ID_OFFSET

    max_images = ImageLimits().max_images
    if len(images) > max_images:
        raise ValueError(f"{len(images)} images in one request; allowed: at most {max_images}")
    out, prev_end = [], 0
    for i, im in enumerate(images):
        if im.start < prev_end or im.length < 1 or im.start + im.length > len(prompt_ids):
            raise ValueError(f"image {i}: span [{im.start}, {im.start + im.length}) does not fit the prompt of "
                             f"{len(prompt_ids)} tokens after the previous span; allowed: ordered, disjoint spans")
        resized = _resized(im, vision.cfg, i)
        if resized.layout.num_tokens != im.length:
            raise ValueError(f"image {i}: its span has {im.length} tokens but its canvas needs "
                             f"{resized.layout.num_tokens}; allowed: the span the frontend planned for it")
        span = prompt_ids[im.start:im.start + im.length]
        if span[0] != vocab_size + IMAGE_ID_OFFSET or any(t != vocab_size + PAD_ID_OFFSET for t in span[1:]):
            raise ValueError(f"image {i}: the prompt ids at its span are not the span ids ({vocab_size + 2}, then "
                             f"{vocab_size + 1}s); allowed: the prompt as the frontend expanded it")
        out.append(PromptImage(im.start, im.length, resized))
        prev_end = im.start + im.length
    return out


def _resized(im: ImageInput, cfg, i: int):
    """The message's image as the model takes it (processor.ResizedImage), or ValueError naming image i."""
    from deepinfer.models.vision.geometry import canvas_layout
    from deepinfer.models.vision.processor import ResizedImage

    try:
        layout = canvas_layout(im.canvas_width, im.canvas_height, cfg)
    except ValueError as exc:
        raise ValueError(f"image {i}: {exc}") from None
    if not (0 < im.width <= im.canvas_width and 0 < im.height <= im.canvas_height) or \
            len(im.pixels) != im.width * im.height * 3:
        raise ValueError(f"image {i}: {len(im.pixels)} bytes of pixels for a {im.width} x {im.height} image on a "
                         f"{im.canvas_width} x {im.canvas_height} canvas; allowed: width x height x 3 bytes (RGB) of "
                         "an image that fits the canvas")
    return ResizedImage(layout, im.width, im.height, im.pixels)


@dataclass
class SpanRowCache:
    """One sequence's image-span rows while its prefill crosses them: image index -> rows [length, hidden]."""

    images: tuple[PromptImage, ...]
    rows: dict[int, Any] = field(default_factory=dict)

    def missing(self, start: int, end: int) -> list[int]:
        """Images whose span meets positions [start, end) and whose rows are not computed yet."""
        return [i for i, im in enumerate(self.images) if im.start < end and start < im.end and i not in self.rows]

    def take(self, start: int, end: int):
        """(offsets from `start`, rows) of the span positions in [start, end), or None; rows of spans that end
        by `end` are dropped (the prefill has passed them)."""
        import torch

        offsets, parts = [], []
        for i, im in enumerate(self.images):
            lo, hi = max(start, im.start), min(end, im.end)
            if lo >= hi:
                continue
            offsets += range(lo - start, hi - start)
            parts.append(self.rows[i][lo - im.start:hi - im.start])
            if im.end <= end:
                del self.rows[i]
        return (offsets, torch.cat(parts)) if parts else None


def compute_rows(vision, caches: list[tuple[SpanRowCache, list[int]]]) -> None:
    """Runs the ViT and aligner once over every listed image of the step (varlen over images) and stores each
    image's span rows in its cache."""
    wanted = [(cache, i) for cache, idx in caches for i in idx]
    if not wanted:
        return
    rows = vision([cache.images[i].image for cache, i in wanted])
    for (cache, i), r in zip(wanted, rows):
        cache.rows[i] = r
