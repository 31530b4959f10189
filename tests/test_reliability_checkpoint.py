"""Corrupt checkpoints (issue 11): each is refused with one line naming what is wrong; through the CLI, exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import embedded
from deepinfer.models.loading import load_checkpoint
from deepinfer.models.loading.errors import CheckpointError


@pytest.fixture(scope="module")
def tiny():
    return embedded.materialize("tiny-random")


def copy_checkpoint(src, dst, config=None, tokenizer: bytes | None = None, weights=None):
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (dst / "tokenizer.json").write_bytes(tokenizer)
    if weights is not None:
        save_file(weights, str(dst / "model.safetensors"))
    return dst


def text_config_with(tiny, **changes) -> dict:
    config = json.loads((tiny / "config.json").read_text())
    config["text_config"].update(changes)
    return config


CASES = {
    "hidden_size-abc": (lambda t: {"config": text_config_with(t, hidden_size="abc")},
                        "hidden_size='abc' has the wrong type; allowed: an integer"),
    "config-is-a-list": (lambda t: {"config": [1, 2]}, "the top level is a list; allowed: a JSON object"),
    "garbage-tokenizer": (lambda t: {"tokenizer": b"garbage{"}, "not a valid tokenizer.json"),
    "max_position_embeddings-0": (lambda t: {"config": text_config_with(t, max_position_embeddings=0)},
                                  "max_position_embeddings=0 is out of range; allowed: >= 2"),
    "num_hidden_layers--1": (lambda t: {"config": text_config_with(t, num_hidden_layers=-1)},
                             "num_hidden_layers=-1 is out of range; allowed: >= 1"),
    # a loop count that would hang the load, and numbers a step divides by
    "hc_sinkhorn_iters-1e9": (lambda t: {"config": text_config_with(t, hc_sinkhorn_iters=10**9)},
                              "hc_sinkhorn_iters=1000000000 is out of range; allowed: <= 1000"),
    "rms_norm_eps-nan": (lambda t: {"config": text_config_with(t, rms_norm_eps=float("nan"))},
                         "rms_norm_eps=nan is out of range; allowed: a finite number"),
    "rope_theta-negative": (lambda t: {"config": text_config_with(t, rope_theta=-10000.0)},
                            "rope_theta=-10000.0 is out of range; allowed: > 0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_checkpoint_is_one_line_naming_the_field_and_exit_2(case, tiny, tmp_path):
    make, message = CASES[case]
    ckpt = copy_checkpoint(tiny, tmp_path / "ckpt", **make(tiny))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt, weights=False)
    assert message in str(info.value) and "\n" not in str(info.value)
    proc = subprocess.run([sys.executable, "-m", "deepinfer", f"model.path={ckpt}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_a_config_nested_beyond_reason_is_one_line(tiny, tmp_path):
    ckpt = copy_checkpoint(tiny, tmp_path / "ckpt")
    (ckpt / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply") as info:
        load_checkpoint(ckpt, weights=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_naming_the_tensor(value, tiny, tmp_path):
    weights = load_file(str(tiny / "model.safetensors"))
    name = next(n for n, t in weights.items() if t.dtype == torch.float32 and t.dim() == 2 and "embed" not in n)
    weights[name] = weights[name].clone()
    weights[name][3, 1] = value
    ckpt = copy_checkpoint(tiny, tmp_path / "ckpt", weights=weights)
    with pytest.raises(CheckpointError, match="holds a non-finite value") as info:
        load_checkpoint(ckpt)
    assert "[3, 1]" in str(info.value) and "\n" not in str(info.value)


def test_a_nan_checkpoint_through_the_cli_is_one_line_and_exit_2(tiny, tmp_path):
    """Under the CLI the weights load in the engine-core process: its one line reaches the user."""
    weights = load_file(str(tiny / "model.safetensors"))
    name = "embed.weight" if "embed.weight" in weights else next(iter(weights))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[7] = float("nan")
    ckpt = copy_checkpoint(tiny, tmp_path / "ckpt", weights=weights)
    proc = subprocess.run([sys.executable, "-m", "deepinfer", f"model.path={ckpt}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "the engine core failed to start" in lines[0] and "holds a non-finite value" in lines[0]


def test_the_finiteness_check_reads_every_loaded_value_exactly_once(tiny, monkeypatch):
    """One pass over each chunk just written, none over the whole model again (what it costs in load time:
    benchmarks/finiteness_check.py)."""
    import math

    from deepinfer.models.loading import materialize as m

    checked, sizes = {}, {}
    check = m._check_finite

    def counting(item, values, first_row):
        checked[item.name] = checked.get(item.name, 0) + values.numel()
        sizes[item.name] = math.prod(item.shape)
        check(item, values, first_row)

    monkeypatch.setattr(m, "_check_finite", counting)
    load_checkpoint(tiny)
    assert checked and checked == sizes
