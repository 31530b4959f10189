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


def sink_attention_decode(q, q_seq, q_pos, win_kv, win_scale, win_pos, cmp_kv, cmp_scale, sel, sink, scale,
                          window: int):
    """Attention of decode queries over the caches as stored (the TileLang decode kernel's contract).

    q [T, H, D] (RoPE applied); q_seq [T] the slot of each query; q_pos [T] its position. win_kv [S, R, D] uint8
    e4m3 codes with win_scale [S, R, D/32] ue8m0 bytes and win_pos [S, R] (the position each ring row holds; the
    row of position p is p % R, R >= window); cmp_kv [P, D/2] e2m1 pairs with cmp_scale [P, D/16] e4m3 bytes (the
    compressed pool); sel [T, topk] pool rows (-1: none). Keys: the window (positions p-window+1..p, oldest first,
    those the ring holds) then the selected rows, in `sel` order — the same slate `sink_attention` gets from the
    prefill path, so the two agree bitwise."""
    from .cache_formats import Fp4Codec, Fp8Codec

    R = win_kv.shape[1]
    look = q_pos[:, None].long() - (window - 1) + torch.arange(window, device=q.device)[None, :]
    slot, ring = q_seq[:, None].long(), torch.remainder(look, R)
    valid = (look >= 0) & (win_pos[slot, ring].long() == look)
    keys = Fp8Codec().decode(win_kv[slot, ring], win_scale[slot, ring], q.dtype)
    if sel.shape[1]:
        rows = sel.long().clamp_min(0)
        chosen = Fp4Codec(16, True).decode(cmp_kv[rows], cmp_scale[rows], q.dtype)
        keys, valid = torch.cat([keys, chosen], 1), torch.cat([valid, sel >= 0], 1)
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=q.device).masked_fill(~valid, float("-inf"))
    return sink_attention(q, keys, bias, sink, scale)
