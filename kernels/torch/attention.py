"""Shared-latent (K = V) multi-query attention with a per-head sink logit."""

import torch


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: q [S, H, D], kv [K, D] (keys = values), bias [S, K] additive (0 / -inf),
    sink [H] fp32. The sink joins the softmax denominator only. Returns [S, H, D] in q's dtype."""
    logits = torch.einsum("shd,kd->hsk", q, kv) * scale + bias.unsqueeze(0)
    sinks = sink.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sinks.to(logits.dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(kv.dtype)
    return torch.einsum("hsk,kd->shd", probs, kv)
