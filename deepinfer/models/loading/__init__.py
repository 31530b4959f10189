"""Hugging Face checkpoint loading for DeepSeek-V4.1 (safetensors only; FP8/FP4 weights dequantized at load).

    model_dir = resolve_model_dir("deepseek-ai/DeepSeek-V4.1-Flash-1017")   # or a local directory
    ckpt = load_checkpoint(model_dir, dtype=torch.bfloat16, device="cuda")
    ckpt.config, ckpt.weights, ckpt.tokenizer_path, ckpt.skipped
"""

from .checkpoint import Checkpoint, load_checkpoint
from .errors import CheckpointError
from .hub import DEFAULT_MODEL_ID, ENV_MODEL_DIR, resolve_model_dir
from .tensors import Spec, expected_tensors

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "DEFAULT_MODEL_ID",
    "ENV_MODEL_DIR",
    "Spec",
    "expected_tensors",
    "load_checkpoint",
    "resolve_model_dir",
]
