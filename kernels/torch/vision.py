"""Attention of the vision tower: full (non-causal) attention within each image of a batch of images laid back to
back, never across images (varlen over `cu_seqlens`)."""

import torch
import torch.nn.functional as F


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """q, k, v [N, heads, head_dim]: the patches of the images back to back, image i in rows
    [cu_seqlens[i], cu_seqlens[i+1]). Returns [N, heads, head_dim], scale 1/sqrt(head_dim).

    One scaled_dot_product_attention call per image: no padding and no mask, so each image's result is the same
    whatever it is batched with, and on CUDA (bf16/fp16, [1, heads, n, d] with unit-stride channels) torch picks its
    flash kernel, the varlen work without a block-diagonal mask (which would force the non-flash paths)."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        qi, ki, vi = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n_i, head_dim]
        out[start:end] = F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1)
    return out
