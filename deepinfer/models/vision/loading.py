"""Load the image path's tensors from a checkpoint directory: only `vision.*`, `aligner.*` and `image_*` are read
(the text loader sets exactly these aside), each checked against the module's shape and upcast to the compute
dtype (BF16 -> float32 is exact). A missing, extra or misshapen tensor is a one-line CheckpointError."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.models.loading.errors import CheckpointError, name_list, shape_str
from deepinfer.models.loading.names import canonical_name

from .config import VisionConfig
from .model import VisionModel

_ROOTS = ("vision", "aligner", "image_start", "image_end", "image_newline")
_STORED_DTYPES = (torch.bfloat16, torch.float32)  # the norms may be F32 (VISION_SPEC.md §4.5): either is taken


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint: open only the shards that hold image-path tensors
        weight_map = json.loads(index.read_text())["weight_map"]
        wanted = {f for name, f in weight_map.items() if canonical_name(name).split(".", 1)[0] in _ROOTS}
        return [model_dir / f for f in sorted(wanted)]
    return sorted(model_dir.glob("*.safetensors"))


def load_vision_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> VisionModel:
    model_dir = Path(model_dir)
    model = VisionModel(VisionConfig.from_file(model_dir)).to(dtype)
    params = dict(model.named_parameters())
    seen = set()
    for path in _files(model_dir):
        with safe_open(str(path), "pt") as f:
            for stored in f.keys():
                name = canonical_name(stored)
                if name.split(".", 1)[0] not in _ROOTS:
                    continue
                if name not in params:
                    raise CheckpointError(f"{path.name}: unexpected image-path tensor {stored}; allowed: the "
                                          "vision_config's vision.*, aligner.*, image_start/end/newline")
                t = f.get_tensor(stored)
                p = params[name]
                if t.shape != p.shape or t.dtype not in _STORED_DTYPES:
                    raise CheckpointError(f"{path.name}: {stored} is {t.dtype} {shape_str(t.shape)}; allowed: "
                                          f"{shape_str(p.shape)} in BF16 or F32")
                with torch.no_grad():
                    p.copy_(t.to(dtype))
                seen.add(name)
    missing = [n for n in params if n not in seen]
    if missing:
        raise CheckpointError(f"{model_dir}: the checkpoint lacks {len(missing)} image-path tensors "
                              f"({name_list(missing)}); allowed: a checkpoint with a vision tower")
    return model.eval()
