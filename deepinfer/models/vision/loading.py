"""Load the image path's tensors from a checkpoint directory: only `vision.*`, `aligner.*` and `image_*` are read
(the text loader leaves exactly these to this one), each checked against the module's shape and upcast to the
compute dtype (BF16 -> float32 is exact). A missing, extra or misshapen tensor is a one-line CheckpointError.

`checkpoint_vision` decides whether a checkpoint has an image path at all: a vision_config in config.json and the
image-path tensors in its files. Without either the model serves text and refuses images in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.models.loading.errors import CheckpointError, name_list, shape_str
from deepinfer.models.loading.names import canonical_name, is_image_path

from .config import VisionConfig, VisionConfigError
from .model import VisionModel

log = logging.getLogger("deepinfer.loading")

_STORED_DTYPES = (torch.bfloat16, torch.float32)  # the norms may be F32 (VISION_SPEC.md §4.5): either is taken


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint: open only the shards that hold image-path tensors
        weight_map = json.loads(index.read_text())["weight_map"]
        wanted = {f for name, f in weight_map.items() if is_image_path(canonical_name(name))}
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
                if not is_image_path(name):
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


def checkpoint_vision(model_dir: str | Path, stored_names, text_cfg) -> VisionConfig | None:
    """The checkpoint's VisionConfig when config.json has a vision_config and its files hold image-path tensors
    (`stored_names`: the canonical names the text loader left aside); None for a text-only checkpoint. A
    vision_config that does not fit the text model, or image tensors without a vision_config, or a text model
    without `ffn.gate.bias_vl` (image tokens route with it), is a one-line CheckpointError."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    has_tensors = any(is_image_path(n) for n in stored_names)
    if not isinstance(raw.get("vision_config"), dict):
        if has_tensors:
            log.info("%s: image-path tensors without a vision_config in config.json: set aside (text only)",
                     model_dir)
        return None
    if not has_tensors:
        log.info("%s: config.json has a vision_config but the files hold no vision.* / aligner.* / image_* tensors: "
                 "the model serves text only and refuses images", model_dir)
        return None
    try:
        cfg = VisionConfig.from_dict(raw)
    except VisionConfigError as exc:
        raise CheckpointError(str(exc)) from None
    if cfg.text_hidden_size != text_cfg.hidden_size or cfg.vocab_size != text_cfg.vocab_size:
        raise CheckpointError(f"{model_dir}: the image path writes rows of width {cfg.text_hidden_size} for a vocab "
                              f"of {cfg.vocab_size}; the text model has hidden_size {text_cfg.hidden_size} and "
                              f"vocab_size {text_cfg.vocab_size}; allowed: the same values")
    if not 0 <= cfg.image_token_id < text_cfg.vocab_size:
        raise CheckpointError(f"config.json: image_token_id={cfg.image_token_id}; allowed: an id in "
                              f"[0, {text_cfg.vocab_size})")
    return cfg
