"""Shared helpers for tests against the golden reference fixtures (tests/fixtures/deepseek_v41)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41"
NAMES = ("tiny-swa-csa2", "tiny-engram-hc4", "tiny-swa-csa2-fp8fp4")
TOL = 1e-3  # max |logit difference| allowed against the float32 reference


@lru_cache(maxsize=None)
def model(name: str):
    from deepinfer.models import load_model

    return load_model(FIXTURES / name)


@lru_cache(maxsize=None)
def cases(name: str) -> list[dict[str, torch.Tensor]]:
    raw = load_file(FIXTURES / name / "cases.safetensors")
    return [
        {k.split(".", 1)[1]: v for k, v in raw.items() if k.startswith(f"case{i}.")}
        for i in range(len({k.split(".")[0] for k in raw}))
    ]


# a fixture's tokenizer for text-level tests (stop strings, detokenization); its end-of-sequence id
TOKENIZER = FIXTURES / "tiny-engram-hc4" / "tokenizer.json"
EOS = 1


def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER))


def text_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids
