"""The tiny V4.1 text architecture: eight layers at toy widths that cover every V4.1 layer role. deepinfer.embedded
builds the embedded checkpoints from it (config.json's text_config), models.synthetic widens it to V4.1-Flash, and
tools/v41_train sizes its training presets from it.
"""

# Layer schedule (8 layers) covering every V4.1 layer role:
#   0 SWA only | 1 SWA + Engram | 2 ratio-2 KV source + index source | 3 ratio-2 reuse
#   4 ratio-1 KV source + index source + candidate source | 5 ratio-1 reuse + Engram
#   6 ratio-1 Reindex (own indexer query, keys and candidates from 4) | 7 ratio-1 reuse
TEXT_CONFIG = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 528,  # 512 BPE ids + 16 chat special tokens (tokenizer.json's added_tokens)
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [2, 4],
    "index_source_layer_ids": [2, 4, 6],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 8,
    "candidate_block_size": 8,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 16,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 8192,
    "engram_layer_ids": [1, 5],
    "engram_vocab_size": 1000,
    "engram_max_ngram_size": 3,
    "engram_n_heads": 4,
    "engram_head_dim": 32,
    "engram_pad_id": 2,
    "engram_compressed_vocab_size": 422,  # what the shipped tokenizer's normalised vocabulary has (spec §4.9)
    # DSpark draft layers (random, like the rest): drafting and verification run end to end on every machine
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 2,
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 8,
    "dspark_num_experts_per_tok": 2,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
