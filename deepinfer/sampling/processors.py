"""The logit transforms of the sample stage, one function per step; each works row by row on float32 [rows, vocab].

Every function leaves a row untouched when its parameter is off for that row, so a row's result never depends on
which other rows share the batch or what they asked for (a row with top_p=1 is not sorted-and-truncated just
because its neighbour asked for top_p=0.9: float rounding in the cumulative sum would trim its tail).
"""

from __future__ import annotations

import torch

from deepinfer.sampling.fixed_point import fixed_point_weights
from deepinfer.sampling.queued_copy import queued_values

NEG_INF = float("-inf")


def _column(values: list, like: torch.Tensor) -> torch.Tensor:
    return queued_values(values, like.dtype, like.device).unsqueeze(1)


def token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """float32 [rows, vocab]: how many times each token occurs in each row's list."""
    rows = len(token_lists)
    flat = [r * vocab_size + t for r, ids in enumerate(token_lists) for t in ids if 0 <= t < vocab_size]
    counts = torch.zeros(rows * vocab_size, dtype=torch.float32, device=device)
    if flat:
        index = queued_values(flat, torch.int64, device)
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


CANDIDATES = 1024  # top-k/top-p look at this many most likely tokens first, sorting the whole row only if needed


def apply_top_k_top_p_(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], candidates: int = CANDIDATES
) -> None:
    """Keeps each row's k most likely tokens (ties: lowest id first), then the smallest prefix of them, most
    likely first, whose probability mass reaches top_p (the most likely token always stays). top_p is measured
    on the distribution left after top-k, renormalised, with exact integer sums (``fixed_point``).

    The definition is a stable descending sort of the whole row (stable: equal logits stay in id order, so tie
    breaking is a property of the row alone). Sorting a 129k vocabulary costs ~10 ms a row on a CPU core, so rows
    are first cut from their `candidates` most likely tokens, which gives the same result whenever the cut falls
    among candidates whose identity is certain; the other rows take the full sort.
    """
    rows = [r for r, (k, p) in enumerate(zip(top_k, top_p)) if k > 0 or p < 1.0]
    if not rows:
        return
    x = logits[rows]
    ks, ps = [top_k[r] for r in rows], [top_p[r] for r in rows]
    vocab = x.shape[-1]
    width = max([candidates] + ks)
    if 2 * width < vocab:
        out, certain = _cut_from_candidates(x, ks, ps, width)
        redo = [i for i, ok in enumerate(certain) if not ok]
    else:
        out, redo = torch.empty_like(x), list(range(len(rows)))
    if redo:
        out[redo] = _cut_from_sorted_row(x[redo], [ks[i] for i in redo], [ps[i] for i in redo])
    logits[rows] = out


def _drop_past_top_p(vals: torch.Tensor, weights: torch.Tensor, total: torch.Tensor, p: torch.Tensor):
    """vals: logits sorted most likely first, weights their fixed-point weights, total the mass they are measured
    against, p each row's top_p (float64 [rows, 1]). Returns vals with the tokens past each row's top_p mass at
    -inf."""
    mass_before = torch.cumsum(weights, dim=-1) - weights  # mass of the strictly more likely tokens
    # p == 1 keeps every token: an infinite bar. The int64 masses meet the float64 bar in float64 (the comparison's
    # type promotion), as if cast first
    bar = torch.where(p < 1.0, p * total.double(), float("inf"))
    return vals.masked_fill(mass_before >= bar, NEG_INF)


def _k_column(ks: list[int], vocab: int, device) -> torch.Tensor:
    return queued_values([kk if kk > 0 else vocab for kk in ks], torch.int64, device).unsqueeze(1)


def _p_column(ps: list[float], device) -> torch.Tensor:
    return queued_values(ps, torch.float64, device).unsqueeze(1)


def _cut_from_sorted_row(x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
    """The definition: one stable sort of the whole row."""
    return cut_top_k_top_p_sorted(x, _k_column(ks, x.shape[-1], x.device), _p_column(ps, x.device))


def cut_top_k_top_p_sorted(x: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The top-k/top-p cut by its definition, with the parameters as tensors (k int64 [rows, 1], the vocabulary for
    no top-k; p float64 [rows, 1]), so it reads nothing on the host: what a captured CUDA graph can run."""
    vocab = x.shape[-1]
    vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
    vals = vals.masked_fill(torch.arange(vocab, device=x.device).unsqueeze(0) >= k, NEG_INF)
    weights = fixed_point_weights(vals)
    vals = _drop_past_top_p(vals, weights, weights.sum(dim=-1, keepdim=True), p)
    return torch.empty_like(x).scatter_(-1, order, vals)


def _cut_from_candidates(x: torch.Tensor, ks: list[int], ps: list[float], width: int):
    """The same cut from the `width` most likely tokens. torch.topk returns the right values but picks freely
    among ties at its boundary, so only candidates strictly above the smallest candidate value have certain ids;
    a row whose cut keeps more than those is reported uncertain (False) for the full sort."""
    vocab = x.shape[-1]
    vals, ids = torch.topk(x, width, dim=-1)
    ids, by_id = ids.sort(dim=-1)  # canonical order: value descending, then id ascending
    vals, order = torch.sort(vals.gather(-1, by_id), dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    certain = (vals > vals[:, -1:]).sum(dim=-1)
    k = _k_column(ks, vocab, x.device)
    vals = vals.masked_fill(torch.arange(width, device=x.device).unsqueeze(0) >= k, NEG_INF)
    weights = fixed_point_weights(vals, vocab)  # the same integers the full sort computes for these tokens
    # top-p's total: what top-k left, which is among the candidates, or else the whole row's mass
    total = torch.where(k < vocab, weights.sum(dim=-1, keepdim=True), fixed_point_weights(x).sum(-1, keepdim=True))
    vals = _drop_past_top_p(vals, weights, total, _p_column(ps, x.device))
    kept = (vals > NEG_INF).sum(dim=-1)
    out = torch.full_like(x, NEG_INF).scatter_(-1, ids, vals)
    return out, (kept <= certain).tolist()


def apply_min_p_column_(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens whose probability is below min_p times the most likely token's (p_i < min_p * p_max, i.e.
    logit_i < logit_max + log(min_p), which needs no softmax). min_p: a column of the logits' dtype [rows, 1] (0:
    off, log(0) = -inf drops nothing)."""
    threshold = torch.log(min_p) + logits.max(dim=-1, keepdim=True).values
    logits.masked_fill_(logits < threshold, NEG_INF)
