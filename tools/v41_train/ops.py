"""Training versions of the attention-side ops whose inference form cannot train: the inference ops work on
per-query key slates gathered from cache pools (under torch.inference_mode); these take a whole causal sequence
batch [B, T] and express the same arithmetic densely with masks, so autograd runs through them. Each is tested
against its inference op (tests/test_train_default_model.py, float64). Everything else the training model needs
is differentiable as written in deepinfer.kernels.torch and is used from there unchanged.
"""

from __future__ import annotations

import torch


def window_mask(T: int, window: int, device) -> torch.Tensor:
    """[T, T] bool: query p sees window keys at positions p-window+1 .. p (MODEL_V41_SPEC.md §4.4)."""
    p = torch.arange(T, device=device)
    d = p[:, None] - p[None, :]
    return (d >= 0) & (d < window)


def entry_visibility(T: int, ratio: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible count [T], mask [T, G]) for compressed entries of `ratio`: entry g is visible to query p iff
    g < (p + 1) // ratio, i.e. the query has passed the group's last token (§4.6). G = T // ratio."""
    count = (torch.arange(T, device=device) + 1) // ratio
    G = T // ratio
    return count, torch.arange(G, device=device)[None, :] < count[:, None]


def sink_attention_dense(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q [B, T, H, D]; keys [B, S, D] (K = V); mask [B or 1, T, S] bool; sink [H] -> [B, T, H, D].

    The inference op (kernels/torch/attention.py::sink_attention) over each query's slate of exactly the keys
    `mask` admits: logits * scale, the per-head sink logit joins the softmax denominator only, probabilities
    of masked keys are exactly 0 and a query with no visible key gets a zero output."""
    logits = torch.einsum("bthd,bsd->bhts", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    B, H, T, _ = logits.shape
    sinks = sink.float().view(1, H, 1, 1).expand(B, H, T, 1).to(logits.dtype)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values.detach()  # shift: no gradient path needed
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    return torch.einsum("bhts,bsd->bthd", probs, keys)


def indexer_scores_dense(iq: torch.Tensor, ik: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """iq [B, T, h, d]; ik [B, G, d]; weights [B, T, h] (already times h^-1/2) -> [B, T, G]:
    sum_h w * relu(iq_h . ik_g) * scale, the lightning-indexer score (§4.6), differentiable."""
    dots = torch.einsum("bthd,bgd->bthg", iq, ik)
    return (dots.relu() * scale * weights.unsqueeze(-1)).sum(2)


def indexer_kl(scores: torch.Tensor, attn_logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The indexer's training signal (DeepSeek-V3.2's DSA warm-up objective): KL(target || softmax(scores)) over the
    compressed entries each query may see, where the target is the layer's own attention distribution over those
    entries (per head a softmax of q . c over all visible entries, averaged over heads: the L1-normalised head sum),
    detached. scores [B, T, G]; attn_logits [B, H, T, G]; visible [T, G] bool. Queries that see nothing are skipped.
    The top-k selection itself has no gradient; this teaches the indexer to rank the entries attention wants."""
    neg = float("-inf")
    rows = visible.any(-1)
    # a query that sees nothing is scored over everything and then dropped: an all -inf row would put NaN into
    # log_softmax's backward even with a zero incoming gradient
    live = visible | ~rows[:, None]
    with torch.no_grad():
        target = torch.softmax(attn_logits.masked_fill(~live, neg), dim=-1).mean(1)
    logp = torch.log_softmax(scores.masked_fill(~live, neg), dim=-1)
    kl = torch.xlogy(target, target) - torch.where(live, target * logp.clamp_min(-1e30), 0.0)
    return kl.sum(-1)[:, rows].mean()
