"""The packed (varlen) input of one model step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .state import SequenceState


@dataclass
class ForwardBatch:
    """New tokens for several independent sequences. Sequence i appends `token_ids[i]` (a prefill
    chunk at any split, or one decode token) to `states[i]`. With `all_logits`, logits come back for
    every new token, else only for the last new token of each sequence."""

    token_ids: list[list[int]]
    states: list[SequenceState]
    all_logits: bool = False


def to_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """A small host-built tensor on `device` without stalling it: a plain copy to a GPU waits for all queued GPU
    work (the host then idles while the GPU drains, every layer); a pinned non-blocking copy is queued in order."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class PackedBatch:
    """ForwardBatch flattened to token rows, built once per step."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 absolute positions
    starts: list[int]  # first row of each sequence
    lengths: list[int]
    past: list[int]  # tokens each sequence had before this step
    states: list[SequenceState]
    id_list: list[int] = field(default_factory=list)  # `ids` on the host (no device read-back needed)
    scratch: dict = field(default_factory=dict)  # per-step values shared between layers (top-k selection)

    @classmethod
    def pack(cls, batch: ForwardBatch, device) -> "PackedBatch":
        if len(batch.token_ids) != len(batch.states):
            raise ValueError("ForwardBatch: token_ids and states must have the same length")
        lengths = [len(t) for t in batch.token_ids]
        if any(n == 0 for n in lengths):
            raise ValueError("ForwardBatch: every sequence needs at least one new token")
        past = [s.num_tokens for s in batch.states]
        starts, acc = [], 0
        for n in lengths:
            starts.append(acc)
            acc += n
        id_list = [t for seq in batch.token_ids for t in seq]
        ids = to_device(id_list, device)
        positions = to_device([p + j for p, n in zip(past, lengths) for j in range(n)], device)
        return cls(ids, positions, starts, lengths, past, list(batch.states), id_list)

    def rows(self, i: int) -> slice:
        return slice(self.starts[i], self.starts[i] + self.lengths[i])
