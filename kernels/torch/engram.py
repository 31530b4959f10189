"""Engram n-gram memory: the hash of the n-grams ending at each position and the gated add."""

import torch

from .elementwise import ew


def engram_hash(
    tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """tokens [T, N] int64 compressed ids looking back 0..N-1 (pad already substituted);
    multipliers [L, N]; primes [L, N-1, heads]; offsets [L, (N-1)*heads] -> ids [T, L, (N-1)*heads]."""
    products = tokens.unsqueeze(1) * multipliers.unsqueeze(0)  # [T, L, N]
    rolling, out = products[..., 0], []
    for i in range(1, tokens.shape[-1]):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        out.append(rolling.unsqueeze(-1) % primes[:, i - 1].unsqueeze(0))
    return torch.cat(out, dim=-1) + offsets.unsqueeze(0)


def engram_gate(
    streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """streams [T, hc, D]; key [T, hc, D]; value [T, D]; weight [hc, D] (= q_weight * k_weight).
    X_k += sigmoid(signed_sqrt(normalised <X_k, w_k * key_k>)) * value, per token and stream."""
    h, key = streams.float(), key.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight.float() * key).sum(-1) * rstd * h.shape[-1] ** -0.5
    gate = ew(torch.sigmoid, torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
