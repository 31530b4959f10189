"""A row's argmax and max over a vocabulary-wide row in two passes, the same result as ``x.argmax(-1)`` and
``x.max(-1).values``.

Why: torch reduces one wide row in one block; a 129,280-wide fp32 row took ~28 us an argmax on an H100 (six a DSpark
step at B=1: five drafts and the sampler's; `dspark_profile_b1_s31_h100`), ~20 GB/s. Viewed as [rows, chunks,
width / chunks], each chunk is reduced by its own block first. Ties still go to the lowest id: each chunk gives its
max with the first index holding it (torch's documented ``max(dim)`` contract), then the first chunk holding the row's
max wins. Max is exact in any order, so the row max is the same value. A NaN row gives a NaN max and the index of a
NaN, as torch's do (the sampler reports such a row as not finite whatever index it holds).
"""

from __future__ import annotations

import torch

CHUNKS = 256  # at most this many chunks a row (a divisor of its width)
MIN_WIDTH = 32768  # narrower rows are reduced in one pass (fast enough, and fewer launches)


def chunks(width: int) -> int:
    """The chunk count for rows of `width`: the largest divisor of width from CHUNKS down to 16, or 0 (one pass)."""
    if width < MIN_WIDTH:
        return 0
    return next((c for c in range(CHUNKS, 15, -1) if width % c == 0), 0)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (int64; ties: the lowest index) for x [..., V] whose last dim is contiguous."""
    c = chunks(x.shape[-1])
    if not c:
        return x.argmax(dim=-1)
    width = x.shape[-1] // c
    vals, idx = x.unflatten(-1, (c, width)).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return idx.gather(-1, best).add_(best, alpha=width).squeeze(-1)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """x.max(dim=-1).values for x [..., V] whose last dim is contiguous."""
    c = chunks(x.shape[-1])
    if not c:
        return x.max(dim=-1).values
    return x.unflatten(-1, (c, -1)).amax(dim=-1).amax(dim=-1)
