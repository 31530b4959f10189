"""The DeepSeek-V4.1 model: config, per-sequence state, packed forward, checkpoint loading."""

from .batch import ForwardBatch
from .config import ModelConfig, ModelConfigError
from .deepseek_v41 import DeepseekV41Model, load_model
from .state import SequenceState

__all__ = ["DeepseekV41Model", "ForwardBatch", "ModelConfig", "ModelConfigError", "SequenceState", "load_model"]
