"""Shared-latent (K = V) multi-query attention with a per-head sink logit, over per-query key slates."""

import torch


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [T, H, D]; keys [T, K, D]: each query's own key slate (keys = values); bias [T, K] additive
    (0 / -inf); sink [H] fp32 logits that join the softmax denominator only. Returns [T, H, D].

    Batched matmuls over T compute each query independently, so a row's result does not depend on
    the other rows in the batch."""
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale + bias.unsqueeze(1)  # [T, H, K]
    sinks = sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1).to(logits.dtype)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys)
