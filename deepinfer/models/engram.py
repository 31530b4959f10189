"""Engram hashing tables: the tokenizer-normalised compressed vocabulary, the per-layer prime bucket
layout and the hash multipliers (MODEL_V41_SPEC.md §4.9). These must be reproduced exactly or the
pretrained n-gram tables are addressed at random rows."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from .config import ModelConfig


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(vocab_size: int, n_layers: int, max_ngram: int, heads: int) -> list[list[list[int]]]:
    """The prime bucket sizes [layer][n-gram size - 2][head] (spec §4.9): the search restarts at vocab_size for
    each n-gram size but never reuses a prime."""
    primes, seen = [], set()
    for _ in range(n_layers):
        per_layer = []
        for _ in range(max_ngram - 1):
            row, cur = [], vocab_size - 1
            for _ in range(heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                row.append(cur)
            per_layer.append(row)
        primes.append(per_layer)
    return primes


def engram_table_rows(vocab_size: int, n_layers: int, max_ngram: int, heads: int) -> list[int]:
    """Rows of each Engram layer's table (config.engram_num_embeddings) = the sum of its primes."""
    return [sum(map(sum, layer)) for layer in engram_primes(vocab_size, n_layers, max_ngram, heads)]


def compressed_token_map(tokenizer: Tokenizer) -> tuple[list[int], int]:
    """Token id -> id of its normalised form (NFKC, NFD, strip accents, lowercase, collapsed
    whitespace, stripped; a lone space survives); partial-UTF-8 byte tokens keep their raw form.
    New ids are assigned in first-seen order."""
    keep_space = "\ue000"  # private-use sentinel: a token that is exactly one space must not strip to ""
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep_space),
            normalizers.Strip(),
            normalizers.Replace(keep_space, " "),
        ]
    )
    ids: dict[str, int] = {}
    mapping = []
    for tid in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        key = tokenizer.id_to_token(tid) if "\ufffd" in text else (norm.normalize_str(text) or text)
        mapping.append(ids.setdefault(key, len(ids)))
    return mapping, len(ids)


@dataclass(frozen=True)
class EngramTables:
    token_map: tuple[int, ...]  # token id -> compressed id, on the host: hashing reads it per token, no device sync
    pad_id: int  # compressed id of the pad token
    multipliers: torch.Tensor  # [L, N] int64 (odd)
    primes: torch.Tensor  # [L, N - 1, heads] int64
    offsets: torch.Tensor  # [L, (N - 1) * heads] int64

    def to(self, device) -> "EngramTables":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    @classmethod
    def build(cls, cfg: ModelConfig, tokenizer: Tokenizer) -> "EngramTables":
        mapping, size = compressed_token_map(tokenizer)
        if size != cfg.engram_compressed_vocab_size:
            raise ValueError(
                f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size} but the tokenizer's normalised "
                f"vocabulary has {size} entries; the hash would address the wrong table rows"
            )
        n = cfg.engram_max_ngram_size
        primes = engram_primes(cfg.engram_vocab_size, len(cfg.engram_layer_ids), n, cfg.engram_n_heads)
        for layer, rows, expected in zip(cfg.engram_layer_ids, primes, cfg.engram_num_embeddings):
            total = sum(sum(r) for r in rows)
            if total != expected:
                raise ValueError(
                    f"engram_num_embeddings for layer {layer} is {expected} but its prime buckets sum to {total}"
                )
        bound = max(1, (np.iinfo(np.int64).max // size) // 2)
        mults = [
            np.random.default_rng(10007 * layer).integers(0, bound, size=(n,), dtype=np.int64) * 2 + 1
            for layer in cfg.engram_layer_ids
        ]
        flat = [[p for row in layer for p in row] for layer in primes]
        offsets = [[sum(f[:i]) for i in range(len(f))] for f in flat]
        return cls(
            token_map=tuple(mapping),
            pad_id=mapping[cfg.engram_pad_id],
            multipliers=torch.tensor(np.stack(mults)),
            primes=torch.tensor(primes, dtype=torch.int64),
            offsets=torch.tensor(offsets, dtype=torch.int64),
        )
