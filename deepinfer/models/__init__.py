"""The DeepSeek-V4.1 model: config, cache pools, packed forward, checkpoint loading (`load_model`: loading/load.py)."""

from .batch import ForwardBatch, SpanRows
from .config import ModelConfig, ModelConfigError
from .deepseek_v41 import DeepseekV41Model
from .loading.load import load_model
from .cache import SequenceCache

__all__ = ["DeepseekV41Model", "ForwardBatch", "ModelConfig", "ModelConfigError", "SequenceCache", "SpanRows", "load_model"]
