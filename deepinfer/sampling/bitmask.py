"""Token bitmasks: xgrammar's packed layout (int32 words, bit j of word w allows token 32*w + j), applied in torch.

We apply the mask with plain torch ops instead of xgrammar.apply_token_bitmask_inplace because that one may reach
for triton on GPUs, and these few element-wise ops run the same on every device.
"""

from __future__ import annotations

import torch

from deepinfer.sampling.queued_copy import queued

ALL_ALLOWED = -1  # an int32 word with every bit set


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 [rows, ceil(vocab/32)] bitmask allowing every token (xgrammar fills rows in place)."""
    return torch.full((rows, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift is fine: we only keep the lowest bit
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Sets the logits of disallowed tokens to -inf in place; bitmask may live on another device. Columns the
    bitmask does not cover (a mask built for a narrower vocabulary) are left alone."""
    covered = min(logits.shape[-1], bitmask.shape[-1] * 32)
    allowed = unpack_bitmask(queued(bitmask, logits.device), covered)
    logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    return logits


def set_single_token_(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row `row` allows exactly `token_id` (used to force trigger tokens)."""
    bitmask[row].zero_()
    word, bit = divmod(token_id, 32)
    # int32 is signed: bit 31 must be written as the negative number with the same bits.
    value = 1 << bit
    bitmask[row, word] = value - (1 << 32) if bit == 31 else value
