"""The tensor table a ModelConfig implies: every checkpoint name the text model needs, its logical shape, and
the storage formats it may arrive in (MODEL_V41_SPEC.md §8.2, checked against the three golden fixtures)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.models.config import ModelConfig

# Storage kinds. The logical shape is always the dense [out, in] (or [rows, dim]) the model computes with.
FLOAT = "float"  # F32 / BF16 / F16, stored at the logical shape
FP8_BLOCK = "fp8_block"  # F8_E4M3 weight + F8_E8M0 scale per 32x32 block: [ceil(out/32), ceil(in/32)]
FP4_ROWS = "fp4_rows"  # I8 packed e2m1 [out, in/2] + F8_E8M0 scale per row and 32 columns: [out, ceil(in/32)]
FP8_ROWS = "fp8_rows"  # F8_E4M3 table [rows, dim] + F8_E8M0 scale per row and 32 channels (Engram tables)

DENSE = (FLOAT,)
LINEAR = (FLOAT, FP8_BLOCK)  # the projections the release stores in FP8
EXPERT = (FLOAT, FP4_ROWS, FP8_BLOCK)  # routed experts: FP4 in the release, FP8 when expert_dtype is "fp8"
TABLE = (FLOAT, FP8_ROWS)


@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    allowed: tuple[str, ...] = DENSE
    optional: bool = False


def expected_tensors(cfg: ModelConfig, draft_layers: bool = True) -> dict[str, Spec]:
    """Canonical name -> Spec for every tensor of the text model described by `cfg` (no vision), with the DSpark
    draft layers (`mtp.*`) when `draft_layers` and the config has them."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Spec] = {
        "embed.weight": Spec((v, d)),
        # Only a tied checkpoint may omit the head; the loader then reuses the embedding.
        "head.weight": Spec((v, d), optional=cfg.tie_word_embeddings),
        "norm.weight": Spec((d,)),
    }
    for layer in range(cfg.num_hidden_layers):
        out.update({f"layers.{layer}.{k}": s for k, s in layer_tensors(cfg, layer).items()})
    if draft_layers:
        out.update(draft_tensors(cfg))
    return out


def draft_tensors(cfg: ModelConfig) -> dict[str, Spec]:
    """The DSpark stages `mtp.{i}.` (MODEL_V41_SPEC.md §6.1): each a ratio-0 decoder block with its own MoE width,
    plus the context projection on stage 0 and the norm, Markov and confidence heads on the last stage."""
    n = cfg.num_nextn_predict_layers
    if not n:
        return {}
    d, v, rank = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    out: dict[str, Spec] = {}
    for i in range(n):
        out.update({f"mtp.{i}.{k}": s for k, s in draft_stage_tensors(cfg, i).items()})
    last = f"mtp.{n - 1}."
    out["mtp.0.main_proj.weight"] = Spec((d, d * len(cfg.dspark_target_layer_ids)), LINEAR)
    out["mtp.0.main_norm.weight"] = Spec((d,))
    out[last + "norm.weight"] = Spec((d,))
    if rank:
        out[last + "markov_head.embed.weight"] = Spec((v, rank))
        out[last + "markov_head.head.weight"] = Spec((v, rank))
    out[last + "confidence_head.proj.weight"] = Spec((1, d + rank))
    return out


def draft_stage_tensors(cfg: ModelConfig, stage: int) -> dict[str, Spec]:
    """The decoder block of draft stage `stage` (names under `mtp.{stage}.`): its own MoE width, and as a layer id
    past the backbone no compressor, indexer or Engram tensors."""
    return layer_tensors(cfg, cfg.num_hidden_layers + stage, n_exp=cfg.dspark_n_routed_experts)


def layer_tensors(c: ModelConfig, layer: int, n_exp: int | None = None) -> dict[str, Spec]:
    """Decoder block `layer`'s tensors, names under `layers.{layer}.`: the checkpoint layout, written once here;
    models/weights.py fills its weight tree (Layer -> Attention, MoE, Engram ...) from these names."""
    d, h, hd, hc = c.hidden_size, c.num_attention_heads, c.head_dim, c.hc_mult
    q, inter, n_exp = c.q_lora_rank, c.moe_intermediate_size, n_exp or c.n_routed_experts
    mix = (2 + hc) * hc  # mHC mixing outputs: pre weights, post weights and the hc x hc residual matrix
    t: dict[str, Spec] = {
        "attn.attn_sink": Spec((h,)),
        "attn.wq_a.weight": Spec((q, d), LINEAR),
        "attn.q_norm.weight": Spec((q,)),
        "attn.wq_b.weight": Spec((h * hd, q), LINEAR),
        "attn.wkv.weight": Spec((hd, d), LINEAR),
        "attn.kv_norm.weight": Spec((hd,)),
        # Grouped low-rank output: each of o_groups groups maps its H*hd/o_groups slice to o_lora_rank.
        "attn.wo_a.weight": Spec((c.o_groups * c.o_lora_rank, h * hd // c.o_groups), LINEAR),
        "attn.wo_b.weight": Spec((d, c.o_groups * c.o_lora_rank), LINEAR),
        "attn_norm.weight": Spec((d,)),
        "ffn_norm.weight": Spec((d,)),
        "ffn.gate.weight": Spec((n_exp, d)),
        "ffn.gate.bias": Spec((n_exp,)),
        "ffn.gate.bias_vl": Spec((n_exp,), optional=True),  # image-token router bias; unused by text
        # Exactly one shared expert of width moe_intermediate_size, whatever n_shared_experts says.
        "ffn.shared_experts.w1.weight": Spec((inter, d), LINEAR),
        "ffn.shared_experts.w2.weight": Spec((d, inter), LINEAR),
        "ffn.shared_experts.w3.weight": Spec((inter, d), LINEAR),
    }
    for site in ("attn", "ffn"):
        t[f"hc_{site}_fn"] = Spec((mix, hc * d))
        t[f"hc_{site}_base"] = Spec((mix,))
        t[f"hc_{site}_scale"] = Spec((3,))
    for e in range(n_exp):
        t[f"ffn.experts.{e}.w1.weight"] = Spec((inter, d), EXPERT)
        t[f"ffn.experts.{e}.w2.weight"] = Spec((d, inter), EXPERT)
        t[f"ffn.experts.{e}.w3.weight"] = Spec((inter, d), EXPERT)
    if layer in c.kv_source_layer_ids:
        t["attn.compressor.wkv.weight"] = Spec((hd, d))
        t["attn.compressor.norm.weight"] = Spec((hd,))
        if c.compress_ratios[layer] == 2:  # overlapping ratio-2 windows need the softmax gate
            t["attn.compressor.wgate.weight"] = Spec((hd, d))
        # Indexer keys are projected from the compressed latent where it is produced; later index
        # sources score against these keys and so carry no wk/k_norm of their own.
        t["attn.indexer.wk.weight"] = Spec((c.index_head_dim, hd))
        t["attn.indexer.k_norm.weight"] = Spec((c.index_head_dim,))
    if layer in c.index_source_layer_ids:
        t["attn.indexer.wq_b.weight"] = Spec((c.index_n_heads * c.index_head_dim, q), LINEAR)
        t["attn.indexer.weights_proj.weight"] = Spec((c.index_n_heads, d))
    if layer in c.engram_layer_ids:
        rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
        t["engram.embed.weight"] = Spec((rows, c.engram_head_dim), TABLE)
        # Fused K/V projection of the concatenated hashed embeddings into hc+1 streams of width D.
        t["engram.wkv.weight"] = Spec((d * (hc + 1), c.n_hash_cols * c.engram_head_dim), LINEAR)
        t["engram.q_weight"] = Spec((hc, d))
        t["engram.k_weight"] = Spec((hc, d))
    return t
