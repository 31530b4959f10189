"""The input of one model step."""

from __future__ import annotations

from dataclasses import dataclass

from .cache import SequenceCache


@dataclass
class ForwardBatch:
    """New tokens for several independent sequences. Sequence i appends `token_ids[i]` (a prefill chunk at any
    split, or one decode token) to `states[i]`, its place in the cache pools. With `all_logits`, logits come back
    for every new token, else only for the last new token of each sequence."""

    token_ids: list[list[int]]
    states: list[SequenceCache]
    all_logits: bool = False
