"""Lightning-indexer scoring and the (two-level) top-k selection."""

import torch

from .linear import matmul_nt


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """q [S, h, d], k [G, d], weights [S, h] (already scaled by h^-1/2) -> scores [S, G] fp32:
    sum_h w[s, h] * relu(q[s, h] . k[g]) * softmax_scale."""
    S, h, d = q.shape
    scores = matmul_nt(q.float().reshape(S * h, d), k.float()).view(S, h, -1).relu_() * softmax_scale
    return (scores * weights.float().unsqueeze(-1)).sum(dim=1)


def index_topk(
    scores: torch.Tensor,
    visible: torch.Tensor,
    topk: int,
    candidates: torch.Tensor | None = None,
    candidate_blocks: int = 0,
    candidate_block_size: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scores [S, G]; visible [S] = number of compressed entries each query may see.

    Returns (selected [S, G] bool, candidate mask [S, G] bool or None). With `candidates` given
    (a later index source), scores outside it are excluded. With `candidate_blocks` > 0 (the
    candidate source), level 1 keeps the best blocks (block score = max member, the block of the
    newest visible entry always kept) and returns that mask; its own selection is unrestricted."""
    S, G = scores.shape
    ar = torch.arange(G, device=scores.device)
    scores = scores.masked_fill(ar[None, :] >= visible[:, None], float("-inf"))
    cand_mask = None
    if candidate_blocks > 0:
        bs = candidate_block_size
        padded = torch.nn.functional.pad(scores, (0, -G % bs), value=float("-inf"))
        block_scores = padded.unflatten(-1, (-1, bs)).amax(-1)
        nb = block_scores.shape[-1]
        last = (visible - 1).div(bs, rounding_mode="floor")
        block_scores = block_scores.masked_fill(torch.arange(nb, device=scores.device)[None, :] == last[:, None], float("inf"))
        top = block_scores.topk(min(candidate_blocks, nb), dim=-1)
        keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
        cand_mask = keep.repeat_interleave(bs, dim=-1)[:, :G]
    elif candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    k = min(topk, G)
    selected = torch.zeros(S, G, dtype=torch.bool, device=scores.device)
    if k > 0:
        top = scores.topk(k, dim=-1, sorted=False)
        selected.scatter_(-1, top.indices, top.values > float("-inf"))
    return selected, cand_mask
