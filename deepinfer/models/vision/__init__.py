"""DeepSeek-V4.1's image path on the CPU (VISION_SPEC.md, docs/vision.md): bytes -> patches (processor), the ViT
and the 3x3 aligner (tower, aligner), and the image span's ids and embedding rows (span). The loader attaches a
VisionModel as `model.vision`; the engine runs it at prefill (docs/vision.md says how it is wired)."""

from .config import VisionConfig, VisionConfigError
from .decode import ImageLimits
from .errors import ImageInputError
from .geometry import ImageLayout, plan_image
from .processor import ImageProcessor, ProcessedImage, ResizedImage

__all__ = ["ImageInputError", "ImageLayout", "ImageLimits", "ImageProcessor", "ProcessedImage", "ResizedImage",
           "VisionConfig", "VisionConfigError", "plan_image"]
