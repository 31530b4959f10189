"""Checkpoint tensors (canonical names; dense, or kept as stored where the loader was asked to) arranged per layer
for the forward pass."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight, linear_bytes
from deepinfer.kernels.packed_experts import PackedExperts, QuantizedWeight, can_pack, pack_quantized

from .config import ModelConfig

log = logging.getLogger("deepinfer.models")

# Projection weights the model applies through ops.linear: each a dense [out, in] tensor or an Fp8BlockWeight
# (FP8 as stored; wo_a then a list of per-group Fp8BlockWeights).
LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "c_wkv", "c_wgate", "i_wq_b", "i_weights_proj", "i_wk", "e_wkv")
Linear = torch.Tensor | Fp8BlockWeight


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fn, scale, base
    hc_ffn: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    wq_a: Linear
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    wo_a: torch.Tensor | list[Fp8BlockWeight]  # wo_a[g]: group g's [o_lora_rank, H * head_dim / o_groups]
    wo_b: Linear
    attn_sink: torch.Tensor
    gate_weight: torch.Tensor
    gate_bias: torch.Tensor | None
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | PackedExperts  # (w1, w2, w3) per expert
    shared_expert: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | PackedExperts | None
    c_wkv: torch.Tensor | None = None
    c_wgate: torch.Tensor | None = None
    c_norm: torch.Tensor | None = None
    i_wq_b: Linear | None = None
    i_weights_proj: torch.Tensor | None = None
    i_wk: torch.Tensor | None = None
    i_k_norm: torch.Tensor | None = None
    e_table: torch.Tensor | None = None  # engram rows [n, engram_head_dim]
    e_wkv: Linear | None = None
    e_weight: torch.Tensor | None = None  # q_weight * k_weight (only the product is used)
    top_k: int | None = None  # routed experts per token when not the config's num_experts_per_tok (draft layers)


def experts_of(group: list[tuple], dtype: torch.dtype, packed: dict | None = None):
    """One layer's experts as the loader gave them: dense (w1, w2, w3) tuples stay a list; weights kept in their
    stored format (QuantizedWeight) are stacked into PackedExperts, or dequantised when the shape cannot pack.
    `packed`: stacks made so far, by the identity of the group's weights: layers that hold the same expert tensors
    by reference (synthetic full-depth models) share one stack instead of a copy each."""
    if not isinstance(group[0][0], QuantizedWeight):
        return group
    key = tuple(id(w) for e in group for w in e)
    if packed is not None and key in packed:
        return packed[key]
    q = group[0][0]
    if len({w.fmt for e in group for w in e}) == 1 and can_pack(q.fmt, q.shape[0], q.shape[1]):
        out = pack_quantized(group)
    else:
        out = [tuple(w.dense(dtype) for w in e) for e in group]
    if packed is not None:
        packed[key] = out
    return out


def _row_groups(w: Linear, groups: int, rank: int):
    """wo_a [groups * rank, in] -> something whose [g] is group g's [rank, in] projection."""
    if isinstance(w, Fp8BlockWeight):
        return w.row_groups(groups)
    return w.view(groups, rank, w.shape[1])


def linear_weight_bytes(layers: list[LayerWeights]) -> tuple[int, int]:
    """(bytes of the projection weights as held, bytes if the FP8 ones were dense bf16)."""
    return linear_bytes(getattr(lw, f.name) for lw in layers for f in fields(lw) if f.name in LINEARS)


def _single(experts):
    return experts if isinstance(experts, PackedExperts) else experts[0]


def arrange(
    cfg: ModelConfig, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
    experts: Sequence[int] | None = None,
) -> tuple[list[LayerWeights], dict[str, torch.Tensor]]:
    """`experts` (expert parallelism): the logical routed expert of each of this rank's physical slots, in slot
    order (ExpertPlacement.local_logical); each layer's `experts` then holds those, a replicated expert once per
    copy (the same loaded tensors). None: all of them, in id order."""
    ids = range(cfg.n_routed_experts) if experts is None else experts
    packed: dict = {}
    layers = [_layer(cfg, t, f"layers.{i}.", ids, dtype, packed) for i in range(cfg.num_hidden_layers)]
    for i in cfg.engram_layer_ids:
        p = f"layers.{i}."
        layers[i].e_weight = t[p + "engram.q_weight"].float() * t[p + "engram.k_weight"].float()
    held, dense = linear_weight_bytes(layers)
    if held != dense:
        log.info("projection weights: %.3f GB held (FP8 as stored), %.3f GB if dequantised to bf16", held / 1e9,
                 dense / 1e9)
    glob = {"embed": t["embed.weight"], "norm": t["norm.weight"], "head": t.get("head.weight", t["embed.weight"])}
    return layers, glob


@dataclass
class DraftWeights:
    """The DSpark stages (MODEL_V41_SPEC.md §6.1): ratio-0 decoder blocks plus the context projection and heads."""

    layers: list[LayerWeights]
    main_proj: Linear  # [D, D * n_targets]: concatenated target features -> context hidden
    main_norm: torch.Tensor
    norm: torch.Tensor  # before the shared lm head
    markov_embed: torch.Tensor | None  # [V, rank]
    markov_head: torch.Tensor | None  # [V, rank]
    confidence: torch.Tensor  # [D + rank]


def arrange_drafts(cfg: ModelConfig, t: dict[str, torch.Tensor], dtype: torch.dtype) -> DraftWeights | None:
    """The draft layers, or None when the checkpoint was loaded without them."""
    n = cfg.num_nextn_predict_layers
    if not n or "mtp.0.main_proj.weight" not in t:
        return None
    last = f"mtp.{n - 1}."
    layers = [_layer(cfg, t, f"mtp.{i}.", range(cfg.dspark_n_routed_experts), dtype) for i in range(n)]
    for lw in layers:
        lw.top_k = cfg.dspark_num_experts_per_tok
    return DraftWeights(
        layers=layers,
        main_proj=t["mtp.0.main_proj.weight"],
        main_norm=t["mtp.0.main_norm.weight"],
        norm=t[last + "norm.weight"],
        markov_embed=t.get(last + "markov_head.embed.weight"),
        markov_head=t.get(last + "markov_head.head.weight"),
        confidence=t[last + "confidence_head.proj.weight"].reshape(-1).float(),
    )


def _layer(cfg: ModelConfig, t: dict[str, torch.Tensor], p: str, ids: Sequence[int],
           dtype: torch.dtype, packed: dict | None = None) -> LayerWeights:
    def get(name: str, optional: bool = False):
        if optional and p + name not in t:
            return None
        return t[p + name]

    def expert(prefix: str):
        return tuple(get(f"{prefix}.{k}.weight") for k in ("w1", "w2", "w3"))

    return LayerWeights(
        attn_norm=get("attn_norm.weight"),
        ffn_norm=get("ffn_norm.weight"),
        hc_attn=(get("hc_attn_fn"), get("hc_attn_scale"), get("hc_attn_base")),
        hc_ffn=(get("hc_ffn_fn"), get("hc_ffn_scale"), get("hc_ffn_base")),
        wq_a=get("attn.wq_a.weight"),
        q_norm=get("attn.q_norm.weight"),
        wq_b=get("attn.wq_b.weight"),
        wkv=get("attn.wkv.weight"),
        kv_norm=get("attn.kv_norm.weight"),
        wo_a=_row_groups(get("attn.wo_a.weight"), cfg.o_groups, cfg.o_lora_rank),
        wo_b=get("attn.wo_b.weight"),
        attn_sink=get("attn.attn_sink"),
        gate_weight=get("ffn.gate.weight"),
        gate_bias=get("ffn.gate.bias", optional=True),
        experts=experts_of([expert(f"ffn.experts.{e}") for e in ids], dtype, packed),
        shared_expert=(_single(experts_of([expert("ffn.shared_experts")], dtype, packed))
                       if p + "ffn.shared_experts.w1.weight" in t else None),
        c_wkv=get("attn.compressor.wkv.weight", True),
        c_wgate=get("attn.compressor.wgate.weight", True),
        c_norm=get("attn.compressor.norm.weight", True),
        i_wq_b=get("attn.indexer.wq_b.weight", True),
        i_weights_proj=get("attn.indexer.weights_proj.weight", True),
        i_wk=get("attn.indexer.wk.weight", True),
        i_k_norm=get("attn.indexer.k_norm.weight", True),
        e_table=get("engram.embed.weight", True),
        e_wkv=get("engram.wkv.weight", True),
    )
