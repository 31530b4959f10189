"""Manifold-constrained hyper-connections (mHC): the per-site mixes and the stream collapse/expand."""

import torch

from .elementwise import ew

from .linear import linear
from .norm import rms_norm


def mhc_mixes(
    streams: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> pre [T, hc], post [T, hc], comb [T, hc(in), hc(out)] (all fp32).

    One RMS statistic per token over the flattened hc*D stream, one projection by `fn`, then
    sigmoid gates and a Sinkhorn projection of the comb logits (rows = input stream j)."""
    hc = streams.shape[-2]
    flat = streams.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = linear(flat, fn.float())
    scale, base = scale.float(), base.float()
    pre = ew(torch.sigmoid, mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * ew(torch.sigmoid, mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).view(*mixes.shape[:-1], hc, hc)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre_k * X_k in fp32 -> [T, D] in the stream dtype."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def mhc_collapse_norm(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None,
                      eps: float) -> torch.Tensor:
    """rms_norm(mhc_collapse(streams, pre), weight, eps): a site's collapsed streams normalised (the attention and
    FFN inputs, the final norm), one op kind so that kernel backends can do both in one pass."""
    return rms_norm(mhc_collapse(streams, pre), weight, eps)


def mhc_expand(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * x + sum_j comb[j, k] * residual_j (fp32, cast to the residual dtype)."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), residual.float())
    return (post.unsqueeze(-1) * x.float().unsqueeze(-2) + mixed).to(residual.dtype)
