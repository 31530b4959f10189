"""DeepSeek-V4.1 models with random weights built in memory, at any width: the GPU benchmarks and GPU tests use
V4.1-Flash width, which no file on disk holds (~7 GB of FP4 experts per layer), at two depths:

- FLASH_REDUCED: six layers, every layer role once (quick runs);
- FLASH_FULL: the released 40 layers with the released layer pattern (compress ratios, KV / index / candidate
  sources, Engram layers), whose layers of one kind share their weight tensors by reference (`share_layers`) while
  every layer keeps its own caches: a step moves the same bytes and does the same FLOPs per layer as the released
  model (a layer's weights are far larger than the 60 MB L2, so none stays cached between layers), and
  roofline.py's floor is the released model's.

Weights: deepinfer.models.random_weights (the released storage formats, kept as stored as `load_model` holds them).
"""

from __future__ import annotations

from importlib import resources

import torch
from tokenizers import Tokenizer

from deepinfer.kernels.registry import OpSet

from .config import ModelConfig
from .deepseek_v41 import DeepseekV41Model
from .engram import engram_table_rows
from .random_weights import random_weights
from .tiny import TEXT_CONFIG

# Reduced-depth V4.1-Flash: every layer role once (the embedded model's schedule, without its 8-layer tail):
#   0 SWA only | 1 SWA + Engram | 2 ratio-2 KV source + index source | 3 ratio-2 reuse
#   4 ratio-1 KV source + index source + candidate source | 5 ratio-1 reindex (own indexer query, candidates of 4)
FLASH_REDUCED = {
    **TEXT_CONFIG,  # the architecture constants (scoring, mHC, rope bases, eps, ...) of the embedded model
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 6,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0, 2, 2, 1, 1],
    "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 5],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "moe_intermediate_size": 2304,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "rope_scaling": {**TEXT_CONFIG["rope_scaling"], "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576,
    "engram_layer_ids": [1],
    # The released tables have 384M rows (~98 GB each in FP8); a step reads 24 rows per token whatever the table
    # size, so a smaller prime range measures the same traffic. The package tokenizer's normalised vocabulary
    # (TEXT_CONFIG's engram_compressed_vocab_size) stands in for the release tokenizer's.
    "engram_vocab_size": 100000,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "num_nextn_predict_layers": 0,  # no draft layers unless asked (DSPARK_FLASH)
}
# V4.1-Flash at the released depth (MODEL_V41_SPEC.md §1.2): 40 layers, 0-1 SWA (1 with Engram), 2-19 ratio 2
# (KV + index sources 2, 8, 14; 14 with Engram), 20-39 ratio 1 (20 the KV + index + candidate source; 24, 28, 32,
# 36 reindex over 20's candidates). Built with share_layers: six distinct layer kinds hold weights (a ratio-2 or ratio-1 layer that
# reuses its source's KV has the tensors of a SWA layer).
FLASH_FULL = {
    **FLASH_REDUCED,
    "num_hidden_layers": 40,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "engram_layer_ids": [1, 14],
}
# V4.1-Flash's DSpark stages (MODEL_V41_SPEC.md §1.2, §6): config(DSPARK_FLASH) adds them (~2.3 GB of FP4 experts
# each); the drafter reads the last three non-KV-source layers of the reduced model.
DSPARK_FLASH = {
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}


def config(overrides: dict | None = None, full_depth: bool = False) -> ModelConfig:
    """FLASH_REDUCED (or FLASH_FULL with `full_depth`) with `overrides`."""
    text = dict(FLASH_FULL if full_depth else FLASH_REDUCED, **(overrides or {}))
    if text["engram_layer_ids"]:
        text["engram_num_embeddings"] = engram_table_rows(
            text["engram_vocab_size"], len(text["engram_layer_ids"]), text["engram_max_ngram_size"],
            text["engram_n_heads"])
    return ModelConfig.from_dict(text)


def package_tokenizer() -> Tokenizer:
    return Tokenizer.from_str((resources.files("deepinfer.assets") / "tokenizer.json").read_text())


def build_model(cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, backends=None, seed: int = 0,
                packed_experts: bool = True, fp8_linears: bool | None = None,
                batch_invariant: bool = False, share_layers: bool | None = None) -> DeepseekV41Model:
    """`share_layers` (default: when the config is deeper than FLASH_REDUCED): layers of one kind share weights."""
    ops = OpSet.build(torch.device(device).type, backends, batch_invariant=batch_invariant)
    if share_layers is None:
        share_layers = cfg.num_hidden_layers > FLASH_REDUCED["num_hidden_layers"]
    weights = random_weights(cfg, device, dtype, seed, packed_experts, fp8_linears, share_layers=share_layers)
    return DeepseekV41Model(cfg, weights, package_tokenizer() if cfg.engram_layer_ids else None, ops, device, dtype,
                            free_stored_experts=True)
