"""Mixture of experts: the router (scoring, selection-only bias, normalisation) and the experts."""

import torch
import torch.nn.functional as F

from deepinfer.kernels.packed_experts import PackedExperts

from .elementwise import ew
from .linear import linear

_SCORE = {
    "sqrtsoftplus": lambda x: torch.sqrt(ew(F.softplus, x)),
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "sigmoid": lambda x: ew(torch.sigmoid, x),
}


def moe_router(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    gate_temp: float,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (weights [T, k] fp32, expert ids [T, k]). The bias ([E], or [T, E] per token: image-span rows
    select with bias_vl) steers selection only."""
    scores = _SCORE[scoring_func](linear(x.float(), gate_weight.float()) / gate_temp)
    chooser = scores if bias is None else scores + bias.float()
    idx = chooser.topk(top_k, dim=-1)[1]
    w = scores.gather(1, idx)
    if norm_topk_prob and top_k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, idx


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """silu(clamp(x w1^T, max=L)) * clamp(x w3^T, ±L), scaled by the routing weight before w2."""
    gate = linear(x, w1).float()
    up = linear(x, w3).float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    y = ew(F.silu, gate) * up
    if weight is not None:
        y = weight * y
    return linear(y.to(x.dtype), w2)


DENSE_ON_CUDA_UP_TO = 64  # experts: up to this many, the CUDA path runs them all, masked (no host sync)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | PackedExperts,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | PackedExperts | None,
    swiglu_limit: float,
) -> torch.Tensor:
    """Routed experts (w1, w2, w3 per expert, or PackedExperts: each touched expert is dequantised for the call)
    plus the shared expert, accumulated in fp32 in expert order; returns [T, D] in x's dtype. An id of -1 in
    `idx` is no expert: it adds nothing (expert parallelism's fixed-size receive buffers mark their unused rows so).

    The experts a batch touches are found on the host, which a captured CUDA graph cannot do: on CUDA, a model
    with few experts runs every expert over every token instead, masked by its routing weight (0 for tokens that
    did not choose it, whose rows add exact zeros). With hundreds of experts that would read them all each call,
    so those stay on the touched-experts loop (not capturable; the TileLang grouped GEMM is)."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    num_experts = experts.n_experts if isinstance(experts, PackedExperts) else len(experts)
    if x.is_cuda and num_experts <= DENSE_ON_CUDA_UP_TO:
        for e in range(num_experts):
            w1, w2, w3 = _expert(experts, e, x.dtype)
            weight = (weights * (idx == e)).sum(-1, keepdim=True)  # a token chooses an expert at most once
            y += swiglu_expert(x, w1, w2, w3, swiglu_limit, weight).float()
    else:
        for e in torch.unique(idx).tolist():
            if e < 0:
                continue
            rows, slot = torch.where(idx == e)
            w1, w2, w3 = _expert(experts, e, x.dtype)
            y[rows] += swiglu_expert(x[rows], w1, w2, w3, swiglu_limit, weights[rows, slot, None]).float()
    if shared is not None:
        y += swiglu_expert(x, *_expert(shared, 0, x.dtype) if isinstance(shared, PackedExperts) else shared,
                           swiglu_limit).float()
    return y.to(x.dtype)


def _expert(experts, e: int, dtype: torch.dtype):
    return experts.dense(e, dtype) if isinstance(experts, PackedExperts) else experts[e]
