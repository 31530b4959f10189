"""Engram n-gram memory: the hash of the n-grams ending at each position and the gated add."""

import torch

from deepinfer.kernels.registry import batch_invariant

from .elementwise import ew

# ATen's CUDA row reductions pick their lanes and block split by the row count; the batch-invariant mode runs the
# gate over chunks of exactly this many tokens (the last one padded) so a token's sums do not follow its batch.
CUDA_INVARIANT_TOKENS = 64


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
    if streams.is_cuda and batch_invariant():
        return _in_token_chunks(streams, key, value, weight, eps)
    return _gate(streams, key, value, weight, eps)


def _gate(streams, key, value, weight, eps):
    h, key = streams.float(), key.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight.float() * key).sum(-1) * rstd * h.shape[-1] ** -0.5
    gate = ew(torch.sigmoid, torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


def _in_token_chunks(streams, key, value, weight, eps):
    n, t = CUDA_INVARIANT_TOKENS, streams.shape[0]
    pad = -t % n

    def padded(x):
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x

    streams, key, value = padded(streams), padded(key), padded(value)
    out = torch.empty_like(streams)
    for s in range(0, t + pad, n):
        out[s:s + n] = _gate(streams[s:s + n], key[s:s + n], value[s:s + n], weight, eps)
    return out[:t]
