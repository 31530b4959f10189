"""DeepSeek-V4.1 models with random weights built in memory, at any width: the GPU layer benchmark and GPU tests
use V4.1-Flash width at reduced depth, which no file on disk holds (~7 GB of FP4 experts per layer).

Weights follow the released storage formats: routed experts are random FP4 e2m1 codes with ue8m0 scales per row
and 32 columns and the shared expert FP8 e4m3 with 32x32 block scales, both kept as stored (QuantizedWeight ->
PackedExperts) exactly as `load_model(..., packed_experts=True)` holds a real checkpoint; FP8 projections are
e4m3 with 32x32 block scales too, kept as stored (Fp8BlockWeight) when `fp8_linears` (the default on CUDA, as
`load_model`) and otherwise dequantised once (the same values); Engram tables carry values an FP8 checkpoint can
hold (quantised and dequantised once); the rest is bf16 / fp32 as the release stores it. Scales are drawn so
activations keep unit variance through every projection (the golden fixtures' initialisation,
deepinfer.embedded._init).
"""

from __future__ import annotations

import math
from importlib import resources

import torch
from tokenizers import Tokenizer

from deepinfer.kernels.fp8_weight import Fp8BlockWeight
from deepinfer.kernels.packed_experts import QuantizedWeight
from deepinfer.kernels.registry import OpSet
from deepinfer.kernels.torch.quant import FP8_MAX, ceil_pow2

from deepinfer.embedded import TEXT_CONFIG, _init, engram_table_rows

from .config import ModelConfig
from .deepseek_v41 import DeepseekV41Model
from .loading import tensors as kinds
from .loading.names import keeps_float32

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


def config(overrides: dict | None = None) -> ModelConfig:
    text = dict(FLASH_REDUCED, **(overrides or {}))
    if text["engram_layer_ids"]:
        text["engram_num_embeddings"] = engram_table_rows(
            text["engram_vocab_size"], len(text["engram_layer_ids"]), text["engram_max_ngram_size"],
            text["engram_n_heads"])
    return ModelConfig.from_dict(text)


def package_tokenizer() -> Tokenizer:
    return Tokenizer.from_str((resources.files("deepinfer.assets") / "tokenizer.json").read_text())


def random_weights(cfg: ModelConfig, device, dtype=torch.bfloat16, seed: int = 0, packed_experts: bool = True,
                   fp8_linears: bool | None = None, draft_layers: bool = True):
    """Canonical name -> tensor (or QuantizedWeight for experts when `packed_experts`, Fp8BlockWeight for the FP8
    projections when `fp8_linears`; default: on CUDA) for `cfg`, with the DSpark draft layers when `draft_layers`
    and the config has them. The values do not depend on `packed_experts` or `fp8_linears` (dense weights are the
    stored formats dequantised). A tied config's head is its embedding (as the checkpoint loader does)."""
    if fp8_linears is None:
        fp8_linears = torch.device(device).type == "cuda"
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, spec in sorted(kinds.expected_tensors(cfg, draft_layers).items()):
        if spec.optional:
            continue
        expert = ".ffn.experts." in name or ".ffn.shared_experts." in name
        if expert and kinds.FP4_ROWS in spec.allowed:
            q = _fp4_rows(spec.shape, gen)
            out[name] = q if packed_experts else q.dense(dtype)
            continue
        w = _init(name, spec.shape, cfg.hidden_size, gen)
        if packed_experts and expert:
            out[name] = _fp8_blocks(w)
        elif fp8_linears and not expert and kinds.FP8_BLOCK in spec.allowed:
            q = _fp8_blocks(w)
            out[name] = Fp8BlockWeight(q.weight, q.scale)
        elif kinds.FP8_BLOCK in spec.allowed or kinds.FP8_ROWS in spec.allowed:
            out[name] = _fp8_values(w, (32, 32) if kinds.FP8_BLOCK in spec.allowed else (1, 32)).to(dtype)
        else:
            out[name] = w.float() if keeps_float32(name) else w.to(dtype)
    if "head.weight" not in out:  # tie_word_embeddings
        out["head.weight"] = out["embed.weight"]
    return out


def _fp4_rows(shape, gen) -> QuantizedWeight:
    """Uniform e2m1 codes (RMS 2.93) with a scale of about 1 / (2.93 sqrt(fan_in)): unit-variance outputs."""
    rows, cols = shape
    centre = 127 + round(math.log2(1.0 / (2.93 * math.sqrt(cols))))
    w = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen, device=gen.device)
    s = torch.randint(centre - 1, centre + 2, (rows, cols // 32), dtype=torch.uint8, generator=gen, device=gen.device)
    return QuantizedWeight("fp4", w, s, (rows, cols))


def _block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    r, c = w.shape
    amax = w.float().view(r // block[0], block[0], c // block[1], block[1]).abs().amax(dim=(1, 3))
    return ceil_pow2(amax.clamp_min(1e-30) / FP8_MAX)


def _fp8_blocks(w: torch.Tensor) -> QuantizedWeight:
    s = _block_scales(w, (32, 32))
    full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    codes = (w.float() / full).to(torch.float8_e4m3fn).view(torch.uint8)
    return QuantizedWeight("fp8", codes, (torch.log2(s).round() + 127).to(torch.uint8), tuple(w.shape))


def _fp8_values(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    s = _block_scales(w, block)
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (w.float() / full).to(torch.float8_e4m3fn).float() * full


def build_model(cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, backends=None, seed: int = 0,
                packed_experts: bool = True, fp8_linears: bool | None = None,
                batch_invariant: bool = False) -> DeepseekV41Model:
    ops = OpSet.build(torch.device(device).type, backends, batch_invariant=batch_invariant)
    weights = random_weights(cfg, device, dtype, seed, packed_experts, fp8_linears)
    return DeepseekV41Model(cfg, weights, package_tokenizer() if cfg.engram_layer_ids else None, ops, device, dtype)
