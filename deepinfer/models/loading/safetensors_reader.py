"""Find a checkpoint's safetensors files (single file or sharded index), read their headers, and hand out lazy
per-tensor reads. Safetensors only: a pickle checkpoint is refused here, never opened."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError, name_list

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    key: str  # the name as stored in the file (maybe "model."-prefixed)
    dtype: str  # safetensors dtype string: F32, BF16, F8_E4M3, F8_E8M0, I8, ...
    shape: tuple[int, ...]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the model: the index's shards, else model.safetensors."""
    index = model_dir / INDEX
    if index.is_file():
        weight_map = _read_index(index)
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: weight_map names shard file(s) that do not exist: {name_list(missing)}")
        return [model_dir / s for s in shards]
    if (model_dir / SINGLE).is_file():
        return [model_dir / SINGLE]
    pickles = sorted({p.name for pat in _PICKLE_PATTERNS for p in model_dir.glob(pat)})
    if pickles:
        raise CheckpointError(
            f"{model_dir}: only PyTorch pickle weights found ({name_list(pickles)}); DeepInfer loads safetensors "
            f"only and never unpickles; convert the checkpoint to {SINGLE} (or shards + {INDEX})"
        )
    orphans = sorted(p.name for p in model_dir.glob("model-*-of-*.safetensors"))
    if orphans:
        raise CheckpointError(f"{model_dir}: shard files ({name_list(orphans)}) found but {INDEX} is missing")
    raise CheckpointError(f"{model_dir}: no {SINGLE} or {INDEX} found")


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: cannot read the shard index ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must be an object mapping tensor names to shard files")
    for shard in set(weight_map.values()):
        # Shards must sit inside the model directory; an index must not point the loader elsewhere.
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointError(f"{index}: shard path {shard!r} must be a file name inside the model directory")
    return weight_map


class SafetensorsFiles:
    """Open handles on a checkpoint's files. Use as a context manager; tensors are read one at a time (the files
    are memory-mapped by safetensors), so loading never holds a second copy of the model."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files = weight_files(model_dir)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self.tensors: dict[str, StoredTensor] = {}

    def __enter__(self) -> "SafetensorsFiles":
        try:
            for f in self.files:
                self._scan(f)
            self._check_index()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _scan(self, file: Path) -> None:
        try:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            entries = []
            for key in handle.keys():
                sl = handle.get_slice(key)
                entries.append(StoredTensor(file, key, str(sl.get_dtype()), tuple(sl.get_shape())))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
        self._handles[file] = handle
        for entry in entries:
            if entry.key in self.tensors:
                raise CheckpointError(
                    f"tensor {entry.key!r} is stored twice: in {self.tensors[entry.key].file.name} and {file.name}"
                )
            self.tensors[entry.key] = entry

    def _check_index(self) -> None:
        index = self.model_dir / INDEX
        if not index.is_file():
            return
        lost = [
            k for k, shard in _read_index(index).items()
            if k not in self.tensors or self.tensors[k].file.name != Path(shard).name
        ]
        if lost:
            raise CheckpointError(f"{index}: tensors listed in weight_map are not in their shard: {name_list(lost)}")

    def rows(self, t: StoredTensor, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of a stored tensor (the whole tensor when no range or it is 0-/1-D), on the CPU."""
        try:
            handle = self._handles[t.file]
            if start is None or len(t.shape) < 2:
                return handle.get_tensor(t.key)
            return handle.get_slice(t.key)[start:stop]
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{t.file}: cannot read tensor {t.key!r} ({exc})") from None
