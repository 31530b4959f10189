"""The golden vision fixture tiny-vit2 (a copy of shared/fixtures/deepseek_v41_vision/tiny-vit2; its README says
how it was made): the config, the three case PNGs, and every stage's stored tensors."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from safetensors import safe_open

VISION_FIXTURE = Path(__file__).parent / "fixtures" / "deepseek_v41_vision" / "tiny-vit2"
CASES = (0, 1, 2)


@cache
def stored() -> dict:
    """Every tensor of cases.safetensors by name, plus 'cases' (the per-case geometry) and 'texts'."""
    with safe_open(str(VISION_FIXTURE / "cases.safetensors"), "pt") as f:
        out = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    out["cases"] = json.loads(meta["cases"])
    out["texts"] = json.loads(meta["texts"])
    return out


def case(n: int, key: str):
    return stored()[f"case{n}.{key}"]


def geometry(n: int) -> dict:
    return stored()["cases"][n]


def png(n: int) -> bytes:
    return (VISION_FIXTURE / f"case{n}.png").read_bytes()
