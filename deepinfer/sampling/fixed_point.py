"""Probabilities as int64 fixed-point weights, and the draw that inverts their exact integer CDF.

Why integers: integer addition is associative, so sums and prefix sums of these weights are bit-exact whatever
order a kernel adds them in. Float sums are not: torch picks reduction and scan schedules by tensor shape (CUDA
scans a single row with a different kernel than a batch), which would let a row's top-p cut or drawn token depend
on how many rows share the batch.
"""

from __future__ import annotations

import torch


def fixed_point_scale(vocab: int) -> float:
    """2**(62 - bits(vocab)): vocab weights of at most this much each sum below 2**62, safe in int64."""
    return float(2 ** (62 - vocab.bit_length()))


def fixed_point_weights(logits: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """int64 exp(logit - row max) in fixed point, scaled so a whole row of `vocab` (default: the row's width)
    sums below 2**62. Weights below 2**-(62 - bits(vocab)) of the top token's (e**-31 and less for a 129k
    vocabulary) become 0. A token's weight depends only on its logit, the row max and vocab."""
    scale = fixed_point_scale(vocab or logits.shape[-1])
    x = logits.double()  # exact; its max is the float max, exactly
    # an all -inf row: weights 0, no NaN (one launch, where isfinite + where took six)
    top = x.max(dim=-1, keepdim=True).values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return torch.floor(torch.exp(x - top) * scale).to(torch.int64)


def draw_from_weights(weights: torch.Tensor, uniforms: list[float]) -> list[int]:
    """Per row, the token whose CDF interval holds uniforms[r] * total weight: token i with probability
    weights[i] / sum(weights), exactly (up to the 53 bits of the uniform). Zero-weight tokens are never drawn.

    Inverse-CDF needs one random number per row instead of one per vocabulary entry (Gumbel-max), and the
    integer prefix sum makes the result independent of the batch."""
    u = torch.tensor(uniforms, dtype=torch.float64, device=weights.device)
    return draw_tokens(weights, u).tolist()


def draw_tokens(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """draw_from_weights with the uniforms a float64 tensor [rows] and the tokens an int64 tensor [rows]: no host
    read, so a captured CUDA graph can draw."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(torch.floor(u.unsqueeze(1) * total.double()).to(torch.int64), total - 1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
