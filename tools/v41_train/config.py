"""Model and run sizes of the training presets, and the checkpoint's config.json.

The architecture constants (layer schedule with every V4.1 role, scoring, mHC, rope bases, eps, Engram n-gram
layout, ...) are the embedded default model's (deepinfer.models.tiny.TEXT_CONFIG); a preset overrides sizes only.
`vocab_size` and `engram_compressed_vocab_size` come from the trained tokenizer, `engram_num_embeddings` from
the prime rule, so config.json is always consistent with tokenizer.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from deepinfer import embedded
from deepinfer.models.engram import compressed_token_map, engram_table_rows


@dataclass(frozen=True)
class Run:
    vocab_size: int  # tokenizer ids in all (BPE + special tokens)
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    eval_windows: int  # held-out windows of seq_len
    max_bytes: int | None  # training text (None: the whole stdlib)
    plausibility_prompts: int  # held-out function headers completed by the engine
    model: dict  # TEXT_CONFIG overrides
    # the DSpark draft layers, trained after the backbone on its frozen context features (tools/v41_train/draft.py)
    draft_steps: int = 0
    draft_anchors: int = 0  # drafting blocks per training sequence and step
    draft_lr: float = 0.0


PRESETS = {
    # CI: one CPU thread, < 60 s including tokenizer, data, export, reload and the logits check. Same 8-layer
    # schedule, every mechanism live: window 16 < seq_len, top-k 8 < visible entries, 2 candidate blocks of 8
    # < visible blocks.
    "smoke": Run(vocab_size=400, seq_len=64, batch_size=4, steps=30, lr=1e-2, warmup=3, eval_windows=4,
                 max_bytes=400_000, plausibility_prompts=0,
                 model=dict(hidden_size=64, num_attention_heads=2, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32,
                            o_groups=2, o_lora_rank=32, sliding_window=16, index_n_heads=4, index_head_dim=32,
                            index_topk=8, candidate_topk_blocks=2, candidate_block_size=8, moe_intermediate_size=32,
                            n_routed_experts=4, num_experts_per_tok=2, engram_vocab_size=200, engram_n_heads=2,
                            engram_head_dim=32),
                 draft_steps=12, draft_anchors=8, draft_lr=1e-2),
    # The H200 run (a few minutes): ~5.2 MB exported with the draft layers (the mHC hc_*_fn, F32 as released, are a
    # fifth of it; hidden 160 and 4 draft experts keep the shipped file near the ~5 MB the repo can carry). Window 64
    # and 512-token sequences: ratio-2 entries (256 per sequence) and ratio-1 entries (512) reach far past the
    # window; the indexer keeps 32 of them. Few, large steps: a step of this model is launch-bound, not
    # compute-bound, on an H200 (0.33 s a step, 0.22 s a draft step). 800 x 64 x 512 tokens = ~26M: ~7 passes over
    # the stdlib (3.5M tokens at this vocabulary).
    "h200": Run(vocab_size=1536, seq_len=512, batch_size=64, steps=800, lr=3e-3, warmup=30, eval_windows=256,
                max_bytes=None, plausibility_prompts=100,
                model=dict(hidden_size=160, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64,
                           o_groups=2, o_lora_rank=64, sliding_window=64, index_n_heads=8, index_head_dim=32,
                           index_topk=32, candidate_topk_blocks=8, candidate_block_size=8, moe_intermediate_size=64,
                           n_routed_experts=6, num_experts_per_tok=2, engram_vocab_size=500, engram_n_heads=2,
                           engram_head_dim=32, max_position_embeddings=8192, dspark_n_routed_experts=4),
                draft_steps=500, draft_anchors=64, draft_lr=3e-3),
}


def config_json(run: Run, tokenizer: Tokenizer) -> dict:
    """The composite deepseek_v41 config.json of a trained model (embedded.config_json's layout)."""
    cfg = embedded.config_json()
    text = {**cfg["text_config"], **run.model}
    text["vocab_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
    # DSpark draft layers (the embedded model's count, block, Markov rank and experts): trained after the backbone
    # on its frozen context features, or left out when the preset trains none
    text["num_nextn_predict_layers"] = text["num_nextn_predict_layers"] if run.draft_steps else 0
    text["engram_compressed_vocab_size"] = compressed_token_map(tokenizer)[1]
    text["engram_num_embeddings"] = engram_table_rows(
        text["engram_vocab_size"], len(text["engram_layer_ids"]), text["engram_max_ngram_size"], text["engram_n_heads"])
    cfg["text_config"] = text
    return cfg
