"""The input of one model step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .cache import SequenceCache


@dataclass
class SpanRows:
    """One sequence's image-span rows among its new tokens in a step: `rows[j]` is the embedding of its new token
    `offsets[j]` (counted from the step's first new token of that sequence). Every new token whose id is >=
    vocab_size (a span position, VISION_SPEC.md §6.1) needs one, and no other token may have one."""

    offsets: list[int]
    rows: torch.Tensor  # [len(offsets), hidden]


@dataclass
class ForwardBatch:
    """New tokens for several independent sequences. Sequence i appends `token_ids[i]` (a prefill chunk at any
    split, or one decode token) to `states[i]`, its place in the cache pools. With `all_logits`, logits come back
    for every new token; with `num_logits`, for the last num_logits[i] new tokens of sequence i (a speculative
    verification: the anchor and each draft); else only for the last new token of each sequence.

    `replay`: the pipeline's YOCO replay stage (models/replay.py BoundedReplay) on a prefill step, else None;
    `data_lens`: each sequence's full known length (prompt, + outputs on a recompute), where its keep rectangle
    ends (None: where this step ends).

    `decode_rows`: per sequence, whether its new tokens are tokens the model generated (a decode token, or a
    verification's anchor and drafts) rather than prompt tokens: only those take the decode attention path, in a
    decode-only step and beside prefill chunks alike, so a row's attention does not depend on what it is batched
    with or how its prompt was chunked. None (a standalone forward): every one-token sequence counts as decoding.

    `images`: per sequence, the image-span rows among its new tokens (SpanRows), or None for a sequence without
    any; None for a step without image spans."""

    token_ids: list[list[int]]
    states: list[SequenceCache]
    all_logits: bool = False
    num_logits: list[int] | None = None
    replay: Any = None
    data_lens: list[int] | None = None
    decode_rows: list[bool] | None = None
    images: list[SpanRows | None] | None = None
