"""The weight tree (models/weights.py) is filled from the loader's tensor table (models/loading/tensors.py), the
one place the checkpoint layout is written: every tensor the table lists for a layer or draft stage lands in the
tree, except those the model folds or sets aside."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.models import synthetic
from deepinfer.models.loading.tensors import draft_stage_tensors, expected_tensors, layer_tensors
from deepinfer.models.weights import arrange, arrange_drafts

# folded into Engram.weight (q_weight * k_weight) or unused by the text model (the image-token router bias)
NOT_IN_TREE = ("engram.q_weight", "engram.k_weight", "ffn.gate.bias_vl")


def _storages(obj, out: set) -> set:
    if isinstance(obj, torch.Tensor):
        out.add(obj.untyped_storage().data_ptr())
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, out)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _storages(getattr(obj, f.name), out)
    return out


def test_every_layer_tensor_of_the_table_lands_in_the_tree():
    cfg = synthetic.config(dict(
        hidden_size=64, vocab_size=256, num_attention_heads=2, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, n_routed_experts=8, moe_intermediate_size=16, index_n_heads=2,
        index_head_dim=32, index_topk=8, candidate_topk_blocks=2, engram_vocab_size=100,
        **{**synthetic.DSPARK_FLASH, "dspark_markov_rank": 8, "dspark_n_routed_experts": 4,
           "dspark_noise_token_id": 2, "dspark_num_experts_per_tok": 2}))
    specs = expected_tensors(cfg, draft_layers=True)
    t = {name: torch.ones(s.shape) for name, s in specs.items()}
    layers, _ = arrange(cfg, t)
    drafts = arrange_drafts(cfg, t, torch.float32)
    held = _storages([layers, drafts.layers if drafts else []], set())
    blocks = [f"layers.{i}.{k}" for i in range(cfg.num_hidden_layers) for k in layer_tensors(cfg, i)]
    blocks += [f"mtp.{i}.{k}" for i in range(cfg.num_nextn_predict_layers) for k in draft_stage_tensors(cfg, i)]
    assert drafts is not None and set(blocks) <= set(specs)
    layer_names = [n for n in blocks if not n.endswith(NOT_IN_TREE)]
    assert any(".compressor." in n for n in layer_names) and any(".indexer." in n for n in layer_names)
    assert any(".engram." in n for n in layer_names)
    missing = [n for n in layer_names if t[n].untyped_storage().data_ptr() not in held]
    assert not missing, missing[:10]
    # and the tree's optional parts follow the table: a compressor exactly on the KV sources
    for i, lw in enumerate(layers):
        assert (lw.attn.compressor is not None) == (i in cfg.kv_source_layer_ids)
        assert (lw.engram is not None) == (i in cfg.engram_layer_ids)
