"""Build (broken) checkpoint copies of the golden fixtures in a temp dir for the loading tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41"
FLOAT_FIXTURE = FIXTURES / "tiny-swa-csa2"
QUANT_FIXTURE = FIXTURES / "tiny-swa-csa2-fp8fp4"
ENGRAM_FIXTURE = FIXTURES / "tiny-engram-hc4"
ALL_FIXTURES = (ENGRAM_FIXTURE, FLOAT_FIXTURE, QUANT_FIXTURE)


def copy_fixture(src: Path, dst: Path) -> Path:
    """config.json, tokenizer.json and model.safetensors of a fixture (the expected-output file is not needed)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


def read_tensors(model_dir: Path, file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / file))


def write_tensors(model_dir: Path, tensors: dict[str, torch.Tensor], file: str = "model.safetensors") -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / file))


def edit_tensors(model_dir: Path, edit) -> None:
    """Apply `edit(dict)` (in place) to model.safetensors."""
    tensors = read_tensors(model_dir)
    edit(tensors)
    write_tensors(model_dir, tensors)


def edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg, indent=2))


def expect_error(fn, *needles: str) -> str:
    """Run fn, require a one-line CheckpointError that mentions every needle; return the message."""
    from deepinfer.models.loading import CheckpointError

    with pytest.raises(CheckpointError) as info:
        fn()
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg
