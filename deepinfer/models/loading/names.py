"""Checkpoint tensor names: the canonical (native, prefix-free) form and which names the text model sets aside."""

from __future__ import annotations

import re

# The released files use bare native names; HF-style saves prefix them with "model." and call the head "lm_head".
_PREFIX = "model."
_HEAD_ALIASES = {"lm_head.weight": "head.weight"}

# Tensors that belong to the checkpoint but not to the text model's weight tree: DSpark draft layers (mtp.*,
# loaded by the text loader when asked), the vision tower and its aligner, and the image span embeddings (the image
# path: loaded by models/vision/loading.py when config.json has a vision_config). Recognised, never errors.
_IMAGE_PATH_ROOTS = ("vision", "aligner", "image_start", "image_end", "image_newline")
_SET_ASIDE_ROOTS = ("mtp", *_IMAGE_PATH_ROOTS)

# Parameters the model computes with in float32 whatever the load dtype: the mHC mixing matrices/biases/scales,
# the attention sinks and the router's selection biases (bf16 would perturb Sinkhorn and top-k choices).
_KEEP_FP32 = re.compile(r"(^|\.)(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias(_vl)?)$")


def canonical_name(stored: str) -> str:
    name = stored[len(_PREFIX):] if stored.startswith(_PREFIX) else stored
    return _HEAD_ALIASES.get(name, name)


def is_set_aside(name: str) -> bool:
    return name.split(".", 1)[0] in _SET_ASIDE_ROOTS


def is_image_path(name: str) -> bool:
    """A canonical name of the image path: vision.*, aligner.*, image_start/end/newline."""
    return name.split(".", 1)[0] in _IMAGE_PATH_ROOTS


def set_aside_group(name: str) -> str:
    """'mtp.*', 'vision.*', ... for the one summary log line."""
    return name.split(".", 1)[0] + ".*"


def keeps_float32(name: str) -> bool:
    return bool(_KEEP_FP32.search(name))


def scale_sibling(weight_name: str) -> str:
    """`X.weight` -> `X.scale` (the block/row scales stored next to a quantized weight)."""
    return weight_name[: -len(".weight")] + ".scale" if weight_name.endswith(".weight") else weight_name + ".scale"
