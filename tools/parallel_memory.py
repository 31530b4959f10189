"""Per-rank memory of the full-size DeepSeek-V4.1-Flash under the parallel layouts, as this engine holds it (issue 13
item 7; issue 28: what actually runs).

    python tools/parallel_memory.py                       # markdown tables (docs/parallel.md)
    python tools/parallel_memory.py --redundant 0 --gpu-gb 141 --reserve-gb 10 --max-seqs 256 --drafts 5

Weights: every tensor `deepinfer.models.loading.expected_tensors` lists for the released config (MODEL_V41_SPEC.md
§1.2; 40 backbone layers + 3 DSpark draft layers), in its stored format (§8.2): routed experts FP4 e2m1 + ue8m0
per row and 32 columns, FP8 projections (and the shared experts) e4m3 + ue8m0 per 32x32 block, Engram tables
e4m3 + ue8m0 per row and 32 channels, the rest BF16 or F32 (loading/names.keeps_float32).
Layouts (DEP, FEATURES.md "Parallelism"): attention data parallel, so every rank holds every non-routed-expert
weight and the caches of its own sequences; expert parallel over the same ranks, so each rank holds
(routed + redundant) / ranks physical experts per MoE layer. DSpark's draft layers hold all of their routed experts
on every rank, as this engine runs them (their MoE is rank-local, so drafting has no collective; DeepInfer shards
them like the backbone's). Engram tables (~203 GB as stored), the two ways this engine holds them:
`model.engram_storage=device` (the default): every rank loads the whole tables onto its GPU, dequantised to the
model's bf16 (2 B a value, twice their stored size; DeepInfer's row shard over an engram-parallel group is not
built here), which no layout fits; `model.engram_storage=host` (deepinfer/models/engram_host.py; DeepInfer's
default on NVIDIA): FP8 as stored, pinned in host RAM, one copy per rank (shown: host RAM per rank), nothing on the
GPU. Expert-parallel static dispatch buffers (deepinfer/distributed/ep_dispatch.py StaticBuffers) for --max-seqs
sequences of 1 + --drafts tokens a rank (the engine's ep_max_tokens): 3 row buffers of world x capacity rows
(capacity = tokens x min(top-k, experts per rank)) plus their metadata. Caches: deepinfer/models/cache/pools.py
CacheLayout (bf16 model, 64-token blocks, DSpark rings, rollback 6 = 5 drafts + 1), a sequence costing its slot
plus whole blocks. What is left after weights, buffers and a fixed reserve (activations, CUDA graphs, NCCL: an
assumption, --reserve-gb) goes to caches. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run as a script

import torch  # noqa: E402

from deepinfer.models.cache.pools import CacheLayout  # noqa: E402
from deepinfer.models.config import ModelConfig  # noqa: E402
from deepinfer.models.loading import tensors as kinds  # noqa: E402
from deepinfer.models.loading.names import keeps_float32  # noqa: E402
from deepinfer.distributed.ep_dispatch import capacity_rows  # noqa: E402
from deepinfer.distributed.placement import resolve_num_extra_experts  # noqa: E402

# The released text config (MODEL_V41_SPEC.md §1.1-1.2); the fields not given take the released defaults.
FLASH_CONFIG = {
    "model_type": "deepseek_v41",
    "architectures": ["DeepseekV41ForCausalLM"],
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "text_config": {
        "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8,
        "o_lora_rank": 1024, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "max_position_embeddings": 1048576, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "moe_intermediate_size": 2304, "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rms_norm_eps": 1e-20, "engram_layer_ids": [1, 14], "engram_vocab_size": 16000000,
        "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_n_heads": 8,
        "engram_head_dim": 256, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
        "dspark_num_experts_per_tok": 3, "hidden_act": "silu", "tie_word_embeddings": False,
    },
}
LAYOUTS = {"single": 1, "dep2": 2, "dep4": 4, "dep8": 8}
CONTEXTS = (32768, 131072)
ROLLBACK = 6  # DSpark's 5 drafts + 1 (DecodingSettings.max_rollback)


def stored_bytes(name: str, spec: kinds.Spec) -> int:
    """Bytes of one tensor (and its scale) in the released format."""
    rows, cols = (spec.shape + (1,))[:2] if len(spec.shape) == 1 else spec.shape
    if ".ffn.experts." in name and kinds.FP4_ROWS in spec.allowed:
        return rows * cols // 2 + rows * math.ceil(cols / 32)
    if kinds.FP8_BLOCK in spec.allowed:
        return rows * cols + math.ceil(rows / 32) * math.ceil(cols / 32)
    if kinds.FP8_ROWS in spec.allowed:
        return rows * cols + rows * math.ceil(cols / 32)
    return math.prod(spec.shape) * (4 if keeps_float32(name) else 2)


def weight_groups(cfg: ModelConfig) -> dict[str, int]:
    """Bytes by placement group: routed experts of the backbone / of DSpark (split by EP), Engram tables (as stored,
    and as this engine loads them onto a device: bf16), the rest (replicated on every rank)."""
    out = {"experts": 0, "dspark_experts": 0, "engram_tables": 0, "engram_device": 0, "replicated": 0}
    for name, spec in kinds.expected_tensors(cfg, draft_layers=True).items():
        if spec.optional:
            continue
        b = stored_bytes(name, spec)
        if ".ffn.experts." in name:
            out["dspark_experts" if name.startswith("mtp.") else "experts"] += b
        elif name.endswith("engram.embed.weight"):
            out["engram_tables"] += b
            out["engram_device"] += math.prod(spec.shape) * 2  # dequantised to bf16 (loading/materialize.py)
        else:
            out["replicated"] += b
    return out


def ep_buffer_bytes(cfg: ModelConfig, ranks: int, slots: int, max_seqs: int, drafts: int) -> int:
    """The static-capacity dispatch buffers of one rank (ep_dispatch.StaticBuffers.allocate), 0 without EP."""
    if ranks == 1:
        return 0
    n = ranks * capacity_rows(max_seqs * (1 + drafts), cfg.num_experts_per_tok, slots)
    return 3 * n * cfg.hidden_size * 2 + 2 * n * 8


def per_rank(cfg: ModelConfig, groups: dict[str, int], ranks: int, min_redundant: int) -> dict[str, float]:
    extra = resolve_num_extra_experts(cfg.n_routed_experts, min_redundant if ranks > 1 else 0, ranks)
    slots = (cfg.n_routed_experts + extra) // ranks
    d_extra, d_slots = 0, cfg.dspark_n_routed_experts  # replicated on every rank (see the docstring)
    experts = groups["experts"] * slots / cfg.n_routed_experts
    experts += groups["dspark_experts"] * d_slots / cfg.dspark_n_routed_experts
    return {"extra": extra, "d_extra": d_extra, "slots": slots, "d_slots": d_slots, "experts": experts,
            "replicated": groups["replicated"], "engram_device": groups["engram_device"],
            "engram_host": groups["engram_tables"]}


def sequences(free: float, layout: CacheLayout, context: int) -> int:
    per_seq = layout.slot_bytes() + math.ceil(context / layout.block_size) * layout.block_bytes()
    return max(0, int(free // per_seq))


def say(text: str) -> None:
    print(textwrap.fill(text, width=118))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu-gb", type=float, default=141.0, help="device memory per GPU (GB = 1e9 bytes)")
    ap.add_argument("--reserve-gb", type=float, default=10.0,
                    help="per rank for activations, CUDA graphs, communication buffers (an assumption)")
    ap.add_argument("--redundant", type=int, nargs="+", default=[0, 32],
                    help="EPLB redundant experts per MoE layer, one row each (DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS; "
                         "rounded up so physical experts divide over the ranks); none for single")
    ap.add_argument("--max-seqs", type=int, default=256, help="engine.max_num_seqs (sizes the EP buffers)")
    ap.add_argument("--drafts", type=int, default=5, help="DSpark drafts a step (0: plain decoding)")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_dict(FLASH_CONFIG)
    groups = weight_groups(cfg)
    layout = CacheLayout(cfg, torch.bfloat16, block_size=64, max_rollback=ROLLBACK,
                         draft_layers=cfg.num_nextn_predict_layers)
    gb = 1e9
    total = sum(v for k, v in groups.items() if k != "engram_device")  # the tables once, as stored
    one_expert = groups["experts"] / cfg.n_routed_experts / cfg.num_hidden_layers
    say(f"V4.1-Flash as stored: {total / gb:.1f} GB = routed experts {groups['experts'] / gb:.1f} + DSpark routed "
        f"experts {groups['dspark_experts'] / gb:.1f} + Engram tables {groups['engram_tables'] / gb:.1f} + the rest "
        f"{groups['replicated'] / gb:.1f} (attention, shared experts, router, mHC, embed/head, DSpark heads, Engram "
        f"projections). One routed expert of one layer: {one_expert / 1e6:.1f} MB.")
    print()
    say(f"Caches ({layout.describe()}): per sequence {layout.slot_bytes() / 1e6:.2f} MB + "
        f"{layout.bytes_per_token():.0f} B/token; {args.gpu_gb:g} GB per GPU, {args.reserve_gb:g} GB reserved; "
        "sequence counts before any max_num_seqs cap. Engram tables as this engine loads them onto a GPU (bf16): "
        f"{groups['engram_device'] / gb:.1f} GB; in host RAM (FP8 as stored): {groups['engram_tables'] / gb:.1f} GB "
        f"per rank. EP buffers for {args.max_seqs} sequences x {1 + args.drafts} tokens a rank.")
    print()
    print("| layout | redundant experts (backbone + DSpark) | routed experts per rank and layer (backbone / DSpark) "
          "| routed experts | replicated | EP buffers | Engram on GPU (storage=device) | on GPU | free for caches "
          "| seqs 32K | seqs 128K | Engram in host RAM (storage=host): on GPU | free | seqs 32K | seqs 128K "
          "| pinned host RAM per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(name, ranks, red) for name, ranks in LAYOUTS.items() for red in (args.redundant if ranks > 1 else [0])]
    for name, ranks, red in rows:
        r = per_rank(cfg, groups, ranks, red)
        buffers = ep_buffer_bytes(cfg, ranks, r["slots"], args.max_seqs, args.drafts)
        row = [name, f"{r['extra']} + {r['d_extra']}", f"{r['slots']} / {r['d_slots']}", f"{r['experts'] / gb:.1f}",
               f"{r['replicated'] / gb:.1f}", f"{buffers / gb:.2f}", f"{r['engram_device'] / gb:.1f}"]
        for engram in (r["engram_device"], 0.0):
            weights = r["experts"] + r["replicated"] + buffers + engram
            free = args.gpu_gb * gb - args.reserve_gb * gb - weights
            fits = [f"{sequences(free, layout, c)}" if free > 0 else "—" for c in CONTEXTS]
            row += [f"{weights / gb:.1f}", f"{free / gb:.1f}" if free > 0 else f"**{free / gb:.1f}** (does not fit)",
                    *fits]
        row.append(f"{r['engram_host'] / gb:.1f}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
