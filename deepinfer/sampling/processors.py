"""The logit transforms of the sample stage, one function per step; each works row by row on float32 [rows, vocab].

Every function leaves a row untouched when its parameter is off for that row, so a row's result never depends on
which other rows share the batch or what they asked for (a row with top_p=1 is not sorted-and-truncated just
because its neighbour asked for top_p=0.9: float rounding in the cumulative sum would trim its tail).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _column(values: list, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """float32 [rows, vocab]: how many times each token occurs in each row's list."""
    rows = len(token_lists)
    flat = [r * vocab_size + t for r, ids in enumerate(token_lists) for t in ids if 0 <= t < vocab_size]
    counts = torch.zeros(rows * vocab_size, dtype=torch.float32, device=device)
    if flat:
        index = torch.tensor(flat, dtype=torch.int64, device=device)
        counts.index_add_(0, index, torch.ones(len(flat), dtype=torch.float32, device=device))
    return counts.view(rows, vocab_size)


def apply_repetition_penalty_(logits: torch.Tensor, seen: torch.Tensor, penalty: list[float]) -> None:
    """CTRL-style: a token already seen (prompt or output) has a positive logit divided by the penalty and a
    negative one multiplied by it, so a penalty > 1 always makes it less likely."""
    r = _column(penalty, logits)
    penalised = torch.where(logits > 0, logits / r, logits * r)
    logits.copy_(torch.where(seen, penalised, logits))


def apply_additive_penalties_(
    logits: torch.Tensor, output_counts: torch.Tensor, frequency: list[float], presence: list[float]
) -> None:
    """OpenAI-style: logit -= frequency * count + presence * (count > 0), over generated tokens only."""
    logits -= _column(frequency, logits) * output_counts
    logits -= _column(presence, logits) * (output_counts > 0).to(logits.dtype)


def apply_temperature_(logits: torch.Tensor, temperature: list[float]) -> None:
    logits /= _column(temperature, logits)


def fixed_point_scale(vocab: int) -> float:
    """2**(62 - bits(vocab)): vocab weights of at most this much each sum below 2**62, safe in int64."""
    return float(2 ** (62 - vocab.bit_length()))


def fixed_point_weights(logits: torch.Tensor) -> torch.Tensor:
    """int64 exp(logit - row max) in fixed point, scaled so a whole row sums below 2**62.

    Why integers: integer addition is associative, so sums and prefix sums of these weights are bit-exact whatever
    order a kernel adds them in. Float sums are not: torch picks reduction and scan schedules by tensor shape (a
    single row goes through a different CUDA scan than a batch), which would let a row's top-p cut depend on how
    many rows share the batch. Weights below 2**-(62 - log2 vocab) of the top token (e**-29 and less) become 0."""
    scale = fixed_point_scale(logits.shape[-1])
    top = logits.max(dim=-1, keepdim=True).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # an all -inf row: weights 0, no NaN
    return torch.floor(torch.exp(logits.double() - top.double()) * scale).to(torch.int64)


def apply_top_k_top_p_(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Keeps each row's k most likely tokens (ties: lowest id first), then the smallest prefix of them, most
    likely first, whose probability mass reaches top_p (the most likely token always stays).

    One stable descending sort serves both: stable keeps equal logits in id order, which makes tie-breaking a
    property of the row alone. top_p is measured on the distribution left after top-k, renormalised, with exact
    integer sums (``fixed_point_weights``).
    """
    vocab = logits.shape[-1]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device).unsqueeze(1)
    p = torch.tensor(top_p, dtype=torch.float64, device=logits.device).unsqueeze(1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(rank >= k, NEG_INF)
    weights = fixed_point_weights(sorted_logits)
    total = weights.sum(dim=-1, keepdim=True)
    mass_before = torch.cumsum(weights, dim=-1) - weights  # mass of the strictly more likely tokens
    drop = (mass_before.double() >= p * total.double()) & (p < 1.0)  # p == 1 keeps every token
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    logits.scatter_(-1, order, sorted_logits)


def apply_min_p_(logits: torch.Tensor, min_p: list[float]) -> None:
    """Drops tokens whose probability is below min_p times the most likely token's (p_i < min_p * p_max,
    i.e. logit_i < logit_max + log(min_p), which needs no softmax)."""
    threshold = torch.log(_column(min_p, logits)) + logits.max(dim=-1, keepdim=True).values
    logits.masked_fill_(logits < threshold, NEG_INF)
