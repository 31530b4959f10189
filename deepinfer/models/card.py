"""A checkpoint as a frontend process sees it: config, tokenizer and resolved op backends, no weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from deepinfer.kernels.registry import OpSet

from .config import ModelConfig


@dataclass
class ModelCard:
    """Checked like a full load (config, tokenizer, every tensor's name, dtype and shape from the file headers),
    but the weights stay on disk: the engine-core process loads and runs the model."""

    config: ModelConfig
    tokenizer: Tokenizer
    ops: OpSet
    device: torch.device
    model_dir: Path
    vision: Any = None  # the checkpoint's VisionConfig when it has an image path (models/vision), else None

    def forward(self, batch):
        raise RuntimeError("this process holds no weights: the engine-core process runs the model")
