"""Turn a model reference (local directory or Hugging Face hub id) into a local checkpoint directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import CheckpointError, one_line

DEFAULT_MODEL_ID = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
ENV_MODEL_DIR = "DEEPINFER_HF_MODEL_DIR"
# Only what the engine reads: never *.bin / *.pt (no pickle), no vision processor files.
ALLOW_PATTERNS = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
]
# load_format=dummy reads no weight file: a hub id then downloads only what the config and tokenizer need.
NO_WEIGHT_PATTERNS = ["config.json", "tokenizer.json", "tokenizer_config.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and ".." not in model


def resolve_model_dir(model: str | Path | None = None, weights: bool = True) -> Path:
    """Local checkpoint directory for `model` (None means DEFAULT_MODEL_ID).

    Rule, in order:
    1. `model` is a pathlib.Path, or a string naming an existing local path -> that directory, used as is
       (DEEPINFER_HF_MODEL_DIR is ignored; a Path that does not exist is an error, never a hub id).
    2. `model` is a hub id ("owner/name", the default id included) and DEEPINFER_HF_MODEL_DIR is set and
       non-empty -> that directory replaces the download, whichever hub id was asked for (it must exist).
    3. `model` is a hub id -> huggingface_hub.snapshot_download of config, tokenizer and safetensors files into
       the HF cache (resumable; HF_HUB_OFFLINE=1 restricts it to the cache). With `weights=False` (load_format
       dummy) only config.json and the tokenizer files are downloaded.
    Anything else raises a one-line CheckpointError.
    """
    ref = str(model) if model is not None else DEFAULT_MODEL_ID
    path = Path(ref).expanduser()
    if isinstance(model, Path) or path.exists():
        if not path.exists():
            raise CheckpointError(f"model directory {path} does not exist")
        if not path.is_dir():
            raise CheckpointError(f"model path {path} is not a directory (expected a Hugging Face model directory)")
        return path
    if not is_hub_id(ref):
        raise CheckpointError(f"model {ref!r} is neither an existing local directory nor a hub id 'owner/name'")
    override = os.environ.get(ENV_MODEL_DIR, "").strip()
    if override:
        local = Path(override).expanduser()
        if not local.is_dir():
            raise CheckpointError(f"{ENV_MODEL_DIR}={override!r} (set for {ref!r}) is not an existing directory")
        return local
    return _download(ref, ALLOW_PATTERNS if weights else NO_WEIGHT_PATTERNS)


def _download(repo_id: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    # huggingface_hub reads HF_HUB_OFFLINE once at import; re-reading it here honours a later change too.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except Exception as exc:  # any hub/network/cache failure becomes the same one-line error
        hint = " (offline: HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise CheckpointError(
            f"cannot get hub model {repo_id!r}{hint}: {type(exc).__name__}: {one_line(str(exc))[:300]}; "
            f"set {ENV_MODEL_DIR} or pass a local directory"
        ) from None
