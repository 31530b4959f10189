"""Lightning-indexer scoring and the (two-level) top-k selection."""

import torch


# Queries are scored in chunks of this many tokens: the keys gathered per query stay bounded in memory.
QUERY_CHUNK = 256


def indexer_scores(q: torch.Tensor, k: torch.Tensor, q_seq: torch.Tensor, weights: torch.Tensor,
                   softmax_scale: float, visible: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, h, d]; k [B, G, d] each sequence's keys (padded to G); q_seq [T] the sequence of each query;
    weights [T, h] (already scaled by h^-1/2) -> scores [T, G] fp32: sum_h w[t, h] * relu(q[t, h] . k[g]) * scale.
    With `visible` [T] (entries each query may see), scores past it may be left -inf (the top-k ignores them).

    The dot products are order-free (`_dots`): the model's q and k are FP4 fake-quantised (e2m1 x 2^k), so a score
    does not depend on the summation order, the key count or the batch."""
    T, h, d = q.shape
    B, G = k.shape[0], k.shape[1]
    if q.device.type == "cpu":
        return _scores_by_segment(q, k, q_seq, weights, softmax_scale, visible)
    out = []  # on a device: no host read of q_seq (a CUDA graph may be capturing); each query gathers its keys
    for a in range(0, T, QUERY_CHUNK):
        b = min(T, a + QUERY_CHUNK)
        out.append(_weighted(_dots(q[a:b], k[q_seq[a:b]]), weights[a:b], softmax_scale))
    return torch.cat(out) if out else q.new_zeros(0, G, dtype=torch.float32)


def _scores_by_segment(q, k, q_seq, weights, softmax_scale, visible=None):
    """CPU: a sequence's queries are contiguous. Sequences with one query (decode rows) are scored together in one
    batched product over their own keys; a sequence with several (a prefill chunk) in one product against its keys
    (only as many as its last query sees, when `visible` says), so no key is copied per query. A decode step's work
    does not depend on how many sequences it holds."""
    T, h, _ = q.shape
    out = torch.full((T, k.shape[1]), float("-inf")) if visible is not None else torch.empty(T, k.shape[1])
    ids, counts = torch.unique_consecutive(q_seq, return_counts=True)
    ends = torch.cumsum(counts, 0)
    single = counts == 1
    if bool(single.any()):
        rows = (ends - 1)[single]
        out[rows] = _weighted(_dots(q[rows], k[ids[single]]), weights[rows], softmax_scale)
    for seq, n, end in zip(ids[~single].tolist(), counts[~single].tolist(), ends[~single].tolist()):
        a = end - n
        g = k.shape[1] if visible is None else int(visible[end - 1])  # a chunk's last query sees the most
        rows, keys = q[a:end].reshape(n * h, -1), k[seq, :g]
        if rows.shape[1] == 32:  # one block: a plain GEMM (CPU bmm with a batch of one takes a much slower path)
            dots = torch.mm(rows.float(), keys.float().t()).view(n, h, -1)
        else:
            dots = _dots(rows[None], keys[None]).view(n, h, -1)
        out[a:end, :g] = _weighted(dots, weights[a:end], softmax_scale)
    return out


def _dots(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [n, h, d] . k [n, G, d] -> [n, h, G], order-free: per 32-channel block in fp32 (FP4 values share a
    power-of-two scale inside a block, so a block's products and sums are small integers times one power of two,
    exact in any order), the blocks then added in a fixed order; other widths in float64."""
    n, h, d = q.shape
    if d % 32:
        return torch.bmm(q.double(), k.double().transpose(1, 2)).float()
    nb = d // 32
    qb = q.float().view(n, h, nb, 32).transpose(1, 2).reshape(n * nb, h, 32)
    kb = k.float().view(n, -1, nb, 32).transpose(1, 2).reshape(n * nb, -1, 32)
    parts = torch.bmm(qb, kb.transpose(1, 2)).view(n, nb, h, -1)
    out = parts[:, 0]
    for j in range(1, nb):  # fixed order: block 0, 1, ...
        out = out + parts[:, j]
    return out


def _weighted(dots: torch.Tensor, weights: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """sum_h w[., h] * relu(dots[., h, g]) * scale, in fp32, in head order."""
    return (dots.relu_() * softmax_scale * weights.float().unsqueeze(-1)).sum(dim=1)


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest per row, ties to the lowest index (a stable sort): the same choice at any row width. Callers
    use the chosen *set*, which only a tie across the k-th place can make ambiguous: on the CPU a top-(k+1) shows
    whether any row has one (a finite one: -inf picks are dropped anyway), and only then is the row sorted."""
    if values.device.type == "cpu" and 0 < k < values.shape[-1]:
        v, i = values.topk(k + 1, dim=-1)
        if not bool(((v[..., k - 1] == v[..., k]) & (v[..., k] > float("-inf"))).any()):
            return v[..., :k], i[..., :k]
    v, i = torch.sort(values, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


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
        values, indices = _top(block_scores, min(candidate_blocks, nb))
        keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, indices, values > float("-inf"))
        cand_mask = keep.repeat_interleave(bs, dim=-1)[:, :G]
    elif candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    k = min(topk, G)
    selected = torch.zeros(S, G, dtype=torch.bool, device=scores.device)
    if k > 0:
        values, indices = _top(scores, k)
        selected.scatter_(-1, indices, values > float("-inf"))
    return selected, cand_mask


def mask_to_ids(selected: torch.Tensor, topk: int) -> torch.Tensor:
    """[S, G] bool -> int32 [S, topk]: the selected entry ids ascending, -1 padded."""
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)[:, :topk]
    ids = torch.where(selected.gather(1, order), order, -1).to(torch.int32)
    return torch.nn.functional.pad(ids, (0, topk - ids.shape[1]), value=-1) if ids.shape[1] < topk else ids


def index_topk_ids(scores, visible, topk, candidates=None, candidate_blocks=0, candidate_block_size=0):
    """The selection of `index_topk` as the ids the decode attention reads: int32 [S, topk], ascending entry
    order, -1 padded; the candidate source (candidate_blocks > 0) also returns its candidate mask [S, G] bool,
    which later index layers need: (ids, mask)."""
    sel, cand = index_topk(scores, visible, topk, candidates, candidate_blocks, candidate_block_size)
    ids = mask_to_ids(sel, max(topk, 0))
    return (ids, cand) if candidate_blocks > 0 else ids


def index_topk_rows(scores, visible, topk, rows, tok_seq, candidates=None, candidate_blocks=0,
                    candidate_block_size=0):
    """index_topk_ids's selection as pool rows: rows [B, G] int64 the pool row of entry g of sequence b, tok_seq [S]
    each query's sequence -> int32 [S, topk] rows[tok_seq[q], id], -1 where the id is -1 (and the candidate mask,
    as index_topk_ids, when candidate_blocks > 0)."""
    out = index_topk_ids(scores, visible, topk, candidates, candidate_blocks, candidate_block_size)
    ids = out[0] if candidate_blocks > 0 else out
    sel = rows[tok_seq.long()[:, None], ids.long().clamp(0, rows.shape[1] - 1)]
    sel = sel.masked_fill(ids < 0, -1).to(torch.int32)
    return (sel, out[1]) if candidate_blocks > 0 else sel


def indexer_scores_fp4(q, q_seq, visible, k, k_scale, rows, weights, softmax_scale):
    """The indexer over keys as stored (the TileLang FP4 kernel's contract): q [T, h, d] (FP4 fake-quantised
    values), q_seq [T] the sequence of each query, visible [T] entries it may see; the key pool k [N, d/2] e2m1
    pairs with k_scale [N, d/32] ue8m0 bytes, rows [B, G] the pool row of entry g of sequence b; weights [T, h]
    -> [T, G] fp32, -inf past `visible`."""
    from .cache_formats import Fp4Codec

    keys = Fp4Codec(32, False).decode(k[rows], k_scale[rows], torch.float32)
    scores = indexer_scores(q, keys, q_seq.long(), weights, softmax_scale, visible.long())
    G = scores.shape[1]
    return scores.masked_fill(torch.arange(G, device=q.device)[None, :] >= visible.long()[:, None], float("-inf"))
