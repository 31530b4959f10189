"""Training data: the running interpreter's standard library, split by file, and a byte-level BPE trained on it.

Files: every `*.py` under sysconfig's stdlib path, without site-packages (not the standard library, and it
differs per machine) and without test directories (generated and data-like code); read as UTF-8 (a file that is
not is skipped). The split is by file and deterministic: a file is held out when the first 8 hex digits of the
SHA-256 of its relative path, as an integer, are divisible by HOLDOUT_EVERY; the seed does not move it.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HOLDOUT_EVERY = 40  # ~2.5% of the files
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

# The special tokens and their places follow the package tokenizer (deepinfer/assets/tokenizer.json), which the
# server and deepseek_recipe already use: BOS / EOS / PAD at ids 0-2 (MODEL_V41_SPEC.md §1.1), the BPE vocabulary,
# then the DeepSeek-V4.1 chat markers deepseek_recipe renders (<think>, </think>, <｜System｜>, <｜User｜>,
# <｜Assistant｜>, ..., ｜DSML｜, the vision span markers) in the same order right after it. Read from the asset,
# so the two tokenizers cannot drift apart.
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"


def chat_tokens() -> list[str]:
    added = json.loads((resources.files("deepinfer.assets") / "tokenizer.json").read_text())["added_tokens"]
    head = [a["content"] for a in sorted(added, key=lambda a: a["id"]) if a["id"] < 3]
    assert head == [BOS, EOS, PAD], head
    return [a["content"] for a in sorted(added, key=lambda a: a["id"]) if a["id"] >= 3]


def stdlib_files(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of every stdlib source file, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        try:
            out.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HOLDOUT_EVERY == 0


def split(files: list[tuple[str, str]], max_bytes: int | None = None):
    """(train, held_out) file lists. With `max_bytes` (smoke runs), each side keeps its files in a fixed order
    (by path hash) until it holds that many bytes (held-out: a tenth of it)."""
    train = [f for f in files if not is_held_out(f[0])]
    held = [f for f in files if is_held_out(f[0])]
    if max_bytes is not None:
        train, held = _first_bytes(train, max_bytes), _first_bytes(held, max(1, max_bytes // 10))
    return train, held


def _first_bytes(files, budget: int):
    out, total = [], 0
    for f in sorted(files, key=lambda f: hashlib.sha256(f[0].encode()).hexdigest()):
        if total >= budget:
            break
        out.append(f)
        total += len(f[1])
    return out


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE of `vocab_size` ids in all, in the shape of deepinfer/assets/tokenizer.json: ByteLevel
    pre-tokenizer (GPT-2 regex, no prefix space) and decoder, BOS prepended by the post-processor (the engine's
    prompts start with it), the chat markers as special tokens after the BPE ids."""
    chat = chat_tokens()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(chat), special_tokens=[BOS, EOS, PAD],
                                  min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(chat)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, 0)])
    assert [tok.token_to_id(s) for s in (BOS, EOS, PAD)] == [0, 1, 2]
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, "too little text for the requested vocabulary"
    return tok


def token_stream(tok: Tokenizer, files: list[tuple[str, str]]) -> torch.Tensor:
    """All files as one int64 stream: BOS, the file's tokens, EOS, next file."""
    encs = tok.encode_batch([text for _, text in files], add_special_tokens=False)
    ids = []
    for e in encs:
        ids.append(0)
        ids.extend(e.ids)
        ids.append(1)
    return torch.tensor(ids, dtype=torch.int64)


@dataclass
class Batches:
    """Training windows: [BOS] + a random slice of the stream, so every row starts at position 0 with BOS as a
    prompt does in the engine, and sees code from mid-file as prompts are. Inputs [B, T], targets [B, T]."""

    stream: torch.Tensor
    seq_len: int
    batch_size: int
    gen: torch.Generator

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.seq_len
        starts = torch.randint(0, len(self.stream) - T, (self.batch_size,), generator=self.gen)
        rows = torch.stack([self.stream[s: s + T] for s in starts.tolist()])
        rows = torch.cat([torch.zeros(self.batch_size, 1, dtype=torch.int64), rows], 1)
        return rows[:, :-1], rows[:, 1:]


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out windows: consecutive, non-overlapping slices of the held-out stream, each after a BOS."""
    T = seq_len
    n = min(max_windows, len(stream) // T)
    rows = torch.stack([stream[i * T: (i + 1) * T] for i in range(n)])  # every target token counted once
    rows = torch.cat([torch.zeros(n, 1, dtype=torch.int64), rows], 1)
    return rows[:, :-1], rows[:, 1:]
