"""The DeepSeek-V4.1 model: config, cache pools, packed forward, checkpoint loading."""

from .batch import ForwardBatch
from .config import ModelConfig, ModelConfigError
from .deepseek_v41 import DeepseekV41Model, load_model
from .cache import SequenceCache

__all__ = ["DeepseekV41Model", "ForwardBatch", "ModelConfig", "ModelConfigError", "SequenceCache", "load_model"]
