"""Images in a prompt, on the frontend side (VISION_SPEC.md §2, docs/vision.md): DeepInfer's `multi_modal_data` read
and checked, each image decoded once (bounded: ImageLimits), planned and resized (the CPU half of the processor,
here in the caller's thread and never on the engine core's loop), and each placeholder (`image_token_id`, one per
image, in order) expanded into the image's span (vocab+2, then vocab+1s). The engine core gets the expanded ids and,
per image, its resized pixels, canvas and span (messages.ImageInput); the model centres, normalises and cuts them
into patches on its device when the ViT runs.

Every refusal is one line naming the field and what is allowed.
"""

from __future__ import annotations

from typing import Any

from deepinfer.engine.messages import ImageInput

FIELDS = ("image_bytes", "image_sizes")


class ImagePromptError(ValueError):
    """A prompt's images cannot run; the message is one line, `field` names the request field at fault."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def parse_multi_modal_data(data: Any) -> tuple[list[bytes], list[tuple[int, int]] | None]:
    """DeepInfer's per-prompt dict -> (image bytes, declared (width, height) sizes or None). None or {}: no
    images."""
    if data is None:
        return [], None
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data is a {type(data).__name__}; allowed: a dict with image_bytes (a list "
                         "of encoded images) and optionally image_sizes (a [width, height] per image)")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"multi_modal_data has unknown keys {unknown}; allowed: {', '.join(FIELDS)}")
    images = data.get("image_bytes", [])
    if images is None:
        raise ValueError("multi_modal_data.image_bytes is None (its images failed upstream); allowed: a list of "
                         "encoded images")
    if not isinstance(images, (list, tuple)) or not all(isinstance(b, (bytes, bytearray)) for b in images):
        raise ValueError("multi_modal_data.image_bytes must be a list of bytes (PNG, JPEG or WebP files)")
    sizes = data.get("image_sizes")
    if sizes is not None:
        ok = isinstance(sizes, (list, tuple)) and all(
            isinstance(s, (list, tuple)) and len(s) == 2 and all(type(v) is int and v > 0 for v in s) for s in sizes)
        if not ok:
            raise ValueError("multi_modal_data.image_sizes must be a list of [width, height] pairs of positive "
                             "integers")
        if len(sizes) != len(images):
            raise ValueError(f"multi_modal_data has {len(images)} image_bytes but {len(sizes)} image_sizes; "
                             "allowed: one size per image")
        sizes = [(int(w), int(h)) for w, h in sizes]
    return [bytes(b) for b in images], sizes


class ImagePrompts:
    """Expands prompts for one model. `vision`: its VisionConfig (deepinfer.models.vision), or None for a model
    without an image path, which refuses every image in one line."""

    def __init__(self, vision, limits=None):
        from deepinfer.models.vision import ImageLimits

        self.vision = vision
        self.limits = limits or ImageLimits()

    def expand(self, ids: list[int], images: list[bytes], sizes: list[tuple[int, int]] | None = None,
               field: str = "multi_modal_data", names: list[str] | None = None) -> tuple[list[int], list[ImageInput]]:
        """(the expanded prompt ids, one ImageInput per image); ImagePromptError naming `field`, or the image's
        own name (`names[i]`: where image i sits in the request; default "<field>.image_bytes[i]")."""
        if not images:
            return ids, []
        if self.vision is None:
            raise ImagePromptError(f"{field}: this model has no vision tower (no vision_config, or no vision.* / "
                                   "aligner.* tensors in its checkpoint); allowed: text-only prompts", field)
        from deepinfer.models.vision import ImageInputError, ImageProcessor
        from deepinfer.models.vision.decode import decode_image
        from deepinfer.models.vision.span import expand_prompt

        cfg = self.vision
        processor = ImageProcessor(cfg, self.limits)
        names = names or [f"{field}.image_bytes[{i}]" for i in range(len(images))]
        if len(images) > self.limits.max_images:
            raise ImagePromptError(f"{field}: {len(images)} images in one request; allowed: at most "
                                   f"{self.limits.max_images}", field)
        resized = []
        for i, data in enumerate(images):
            try:
                img = decode_image(data, self.limits, i)  # the image's one decode
            except ImageInputError as exc:  # "image i: why; allowed: ..." -> named by where the image sits
                raise ImagePromptError(f"{names[i]}: {str(exc).split(': ', 1)[1]}", names[i]) from None
            if sizes is not None and tuple(sizes[i]) != img.size:
                raise ImagePromptError(f"{field}.image_sizes[{i}] is {sizes[i][0]} x {sizes[i][1]} but the image "
                                       f"decodes to {img.width} x {img.height}; allowed: its real [width, height]",
                                       f"{field}.image_sizes")
            resized.append(processor.resize(img))
        try:
            prompt = expand_prompt(ids, [r.layout for r in resized], cfg.image_token_id, cfg.vocab_size)
        except ImageInputError as exc:
            raise ImagePromptError(f"{field}: {exc}", field) from None
        spans = [ImageInput(start, length, r.layout.best_width, r.layout.best_height, r.width, r.height, r.pixels)
                 for r, (start, length) in zip(resized, prompt.image_spans)]
        return prompt.input_ids.tolist(), spans
