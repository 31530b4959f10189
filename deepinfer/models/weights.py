"""Checkpoint tensors (canonical names; dense, or kept as stored where the loader was asked to) arranged as a tree
shaped like the checkpoint (Layer -> Attention -> Compressor, Indexer; MoE; Engram) for the forward pass."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass

import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight, linear_bytes
from deepinfer.kernels.packed_experts import PackedExperts, QuantizedWeight, can_pack, pack_quantized

from .config import ModelConfig
from .loading.tensors import Spec, draft_stage_tensors, layer_tensors

log = logging.getLogger("deepinfer.models")

Linear = torch.Tensor | Fp8BlockWeight  # a dense [out, in] projection, or FP8 as stored
Expert = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (w1, w2, w3)

# The weight tree mirrors the checkpoint: a field is the checkpoint key under its object's prefix (`attn.wq_a` is
# `layers.{i}.attn.wq_a.weight`, `hc_attn.fn` is `layers.{i}.hc_attn_fn`), so the tree is filled by walking the
# layer's tensor table (loading/tensors.py: names, shapes, storage formats), the one place the layout is written.
# LINEARS: the fields applied through ops.linear (dense, or Fp8BlockWeight as stored).


@dataclass
class HyperConnection:
    """An mHC site's mixing parameters (`hc_attn_*`, `hc_ffn_*`)."""

    fn: torch.Tensor
    scale: torch.Tensor
    base: torch.Tensor


@dataclass
class Compressor:
    """`attn.compressor.*` of a KV-source layer; wgate only at ratio 2 (overlapping groups need the softmax gate)."""

    LINEARS = ("wkv", "wgate")
    wkv: Linear
    norm: torch.Tensor
    wgate: Linear | None = None


@dataclass
class Indexer:
    """`attn.indexer.*`: the query side on index sources (wq_b, weights_proj), the key side on KV sources (wk,
    k_norm: keys come from the compressed latent where it is produced)."""

    LINEARS = ("wq_b", "weights_proj", "wk")
    wq_b: Linear | None = None
    weights_proj: torch.Tensor | None = None
    wk: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class Attention:
    """`attn.*`."""

    LINEARS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
    wq_a: Linear
    q_norm: torch.Tensor
    wq_b: Linear
    wkv: Linear
    kv_norm: torch.Tensor
    wo_a: torch.Tensor | list[Fp8BlockWeight]  # wo_a[g]: group g's [o_lora_rank, H * head_dim / o_groups]
    wo_b: Linear
    attn_sink: torch.Tensor
    compressor: Compressor | None = None
    indexer: Indexer | None = None


@dataclass
class Gate:
    """`ffn.gate.*`: the router (the biases only select, they do not weight): `bias` for text tokens, `bias_vl`
    for image-span tokens (VISION_SPEC.md §6.3)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    bias_vl: torch.Tensor | None = None


@dataclass
class MoE:
    """`ffn.*`: the router, the routed experts (this rank's physical slots under expert parallelism) and the
    shared expert, each (w1, w2, w3), or stacked as stored (PackedExperts)."""

    gate: Gate
    experts: list[Expert] | PackedExperts
    shared_experts: Expert | PackedExperts | None
    top_k: int | None = None  # routed experts per token when not the config's num_experts_per_tok (draft layers)


@dataclass
class Engram:
    """`engram.*`: the hashed n-gram table, the fused K/V projection and the gate weight."""

    LINEARS = ("wkv",)
    embed: torch.Tensor  # [rows, engram_head_dim]
    wkv: Linear
    weight: torch.Tensor  # q_weight * k_weight: only the product is used


@dataclass
class Layer:
    """One decoder block, `layers.{i}.*` (or a draft stage, `mtp.{i}.*`)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc_attn: HyperConnection
    hc_ffn: HyperConnection
    attn: Attention
    ffn: MoE
    engram: Engram | None = None


def experts_of(group: list[tuple], dtype: torch.dtype, packed: dict | None = None, free_stored: bool = False):
    """One layer's experts as the loader gave them: dense (w1, w2, w3) tuples stay a list; weights kept in their
    stored format (QuantizedWeight) are stacked into PackedExperts, or dequantised when the shape cannot pack.
    `packed`: stacks made so far, by the identity of the group's weights: layers that hold the same expert tensors
    by reference (synthetic full-depth models) share one stack instead of a copy each. `free_stored`: the stored
    tensors' memory is released once stacked (their owner gave them up), so the two copies never coexist."""
    if not isinstance(group[0][0], QuantizedWeight):
        return group
    key = tuple(id(w) for e in group for w in e)
    if packed is not None and key in packed:
        return packed[key]
    q = group[0][0]
    if len({w.fmt for e in group for w in e}) == 1 and can_pack(q.fmt, q.shape[0], q.shape[1]):
        out = pack_quantized(group)
        if free_stored:  # the stacks replace the stored tensors: release those now
            for t in (t for e in group for w in e for t in (w.weight, w.scale)):
                st = t.untyped_storage()  # only a storage of this tensor alone (not a view of a file's mapping)
                if st.resizable() and st.nbytes() == t.nbytes:
                    st.resize_(0)
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


def linear_weight_bytes(layers: list[Layer]) -> tuple[int, int]:
    """(bytes of the projection weights as held, bytes if the FP8 ones were dense bf16)."""
    return linear_bytes(w for lw in layers for w in _linears(lw))


def _linears(obj):
    """The projection weights in `obj`'s subtree (the LINEARS fields of each object)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.name in getattr(obj, "LINEARS", ()):
            yield v
        elif is_dataclass(v):
            yield from _linears(v)


def held_bytes(obj) -> int:
    """Bytes of the distinct tensor storages reachable from `obj` (tensors, lists/tuples/dicts, dataclasses such
    as the weight tree's objects, PackedExperts, Fp8BlockWeight): a tensor referenced twice, or a view, counts
    once."""
    seen: dict[tuple[str, int], int] = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            seen[(str(o.device), st.data_ptr())] = st.nbytes()
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif hasattr(o, "__dataclass_fields__"):
            for name in o.__dataclass_fields__:
                walk(getattr(o, name))

    walk(obj)
    return sum(seen.values())


def _single(experts):
    return experts if isinstance(experts, PackedExperts) else experts[0]


def arrange(
    cfg: ModelConfig, t: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
    experts: Sequence[int] | None = None, free_stored_experts: bool = False,
) -> tuple[list[Layer], dict[str, torch.Tensor]]:
    """`experts` (expert parallelism): the logical routed expert of each of this rank's physical slots, in slot
    order (ExpertPlacement.local_logical); each layer's `experts` then holds those, a replicated expert once per
    copy (the same loaded tensors). None: all of them, in id order. `free_stored_experts`: experts_of's
    `free_stored` (the caller gives `t`'s expert tensors up)."""
    ids = range(cfg.n_routed_experts) if experts is None else experts
    packed: dict = {}
    layers = [_layer(cfg, t, f"layers.{i}.", layer_tensors(cfg, i), ids, dtype, packed, free_stored_experts)
              for i in range(cfg.num_hidden_layers)]
    held, dense = linear_weight_bytes(layers)
    if held != dense:
        log.info("projection weights: %.3f GB held (FP8 as stored), %.3f GB if dequantised to bf16", held / 1e9,
                 dense / 1e9)
    glob = {"embed": t["embed.weight"], "norm": t["norm.weight"], "head": t.get("head.weight", t["embed.weight"])}
    return layers, glob


@dataclass
class DraftWeights:
    """The DSpark stages (MODEL_V41_SPEC.md §6.1): ratio-0 decoder blocks plus the context projection and heads."""

    layers: list[Layer]
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
    layers = [_layer(cfg, t, f"mtp.{i}.", draft_stage_tensors(cfg, i), range(cfg.dspark_n_routed_experts), dtype)
              for i in range(n)]
    for lw in layers:
        lw.ffn.top_k = cfg.dspark_num_experts_per_tok
    return DraftWeights(
        layers=layers,
        main_proj=t["mtp.0.main_proj.weight"],
        main_norm=t["mtp.0.main_norm.weight"],
        norm=t[last + "norm.weight"],
        markov_embed=t.get(last + "markov_head.embed.weight"),
        markov_head=t.get(last + "markov_head.head.weight"),
        confidence=t[last + "confidence_head.proj.weight"].reshape(-1).float(),
    )


def _fp32(w, made: dict | None):
    """A dense projection weight as fp32; `made`: copies by the identity of their source, so layers holding one
    tensor by reference (synthetic full-depth models) share one copy."""
    if not isinstance(w, torch.Tensor) or w.dtype == torch.float32:
        return w
    key = ("fp32", id(w))
    if made is not None and key in made:
        return made[key]
    out = w.float()
    if made is not None:
        made[key] = out
    return out


def _layer(cfg: ModelConfig, t: dict[str, torch.Tensor], p: str, specs: dict[str, Spec], ids: Sequence[int],
           dtype: torch.dtype, packed: dict | None = None, free_stored: bool = False) -> Layer:
    """The layer under prefix `p` (its tensor table `specs`, names relative to p), filled by field name."""

    def fill(cls, prefix: str, optional: bool = False, **given):
        """`cls` from the tensors under p + prefix: field f is the key `f.weight` where the table names it so, else
        `f`; an entry the table requires must be there, others are None when absent; `given`: fields built
        otherwise. `optional`: None when the table has none of cls's tensors (a layer without a compressor)."""
        keys = {f.name: prefix + f.name + ".weight" if prefix + f.name + ".weight" in specs else prefix + f.name
                for f in fields(cls) if f.name not in given}
        if optional and not any(k in specs for k in keys.values()):
            return None
        return cls(**given, **{name: t[p + k] if k in specs and not specs[k].optional else t.get(p + k)
                               for name, k in keys.items()})

    def expert(prefix: str) -> Expert:
        return tuple(t[f"{p}{prefix}.{k}.weight"] for k in ("w1", "w2", "w3"))

    attn = fill(Attention, "attn.", compressor=fill(Compressor, "attn.compressor.", optional=True),
                indexer=fill(Indexer, "attn.indexer.", optional=True))
    attn.wo_a = _row_groups(attn.wo_a, cfg.o_groups, cfg.o_lora_rank)
    c = attn.compressor
    if c is not None and c.wgate is not None:
        # the overlapping (ratio > 1) compressor projects in fp32 (Attention.compress_input): cast once here, not
        # two [head_dim, D] casts a layer every step (the same values)
        c.wkv, c.wgate = _fp32(c.wkv, packed), _fp32(c.wgate, packed)
    routed = experts_of([expert(f"ffn.experts.{e}") for e in ids], dtype, packed, free_stored)
    shared = None
    if p + "ffn.shared_experts.w1.weight" in t:
        shared = _single(experts_of([expert("ffn.shared_experts")], dtype, packed, free_stored))
    ffn = MoE(fill(Gate, "ffn.gate."), routed, shared)
    engram = None
    if "engram.embed.weight" in specs:
        weight = t[p + "engram.q_weight"].float() * t[p + "engram.k_weight"].float()
        engram = fill(Engram, "engram.", weight=weight)
    return fill(Layer, "", hc_attn=fill(HyperConnection, "hc_attn_"), hc_ffn=fill(HyperConnection, "hc_ffn_"),
                attn=attn, ffn=ffn, engram=engram)
