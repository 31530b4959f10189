"""The full-depth synthetic Flash model (synthetic.FLASH_FULL): the released 40-layer pattern, with the layers of one
kind holding one set of weights by reference (so it fits one GPU) while every layer keeps its own caches."""

import torch

from deepinfer.models import synthetic
from deepinfer.models.loading import tensors as kinds
from deepinfer.models.random_weights import shared_layer_names

# Flash's layer pattern at a width a CPU builds in seconds
NARROW = dict(hidden_size=256, vocab_size=512, n_routed_experts=8, moe_intermediate_size=64, q_lora_rank=128,
              num_attention_heads=4, o_lora_rank=64, o_groups=2, index_n_heads=4, index_topk=16,
              candidate_topk_blocks=4, engram_vocab_size=1000, engram_n_heads=2, engram_head_dim=64)


def test_full_depth_config_is_the_released_layer_pattern():
    cfg = synthetic.config(full_depth=True)
    assert cfg.num_hidden_layers == 40
    assert list(cfg.compress_ratios[:40]) == [0, 0] + [2] * 18 + [1] * 20
    assert list(cfg.kv_source_layer_ids) == [2, 8, 14, 20]
    assert list(cfg.index_source_layer_ids) == [2, 8, 14, 20, 24, 28, 32, 36]
    assert cfg.candidate_source_layer_id == 20 and list(cfg.engram_layer_ids) == [1, 14]
    assert cfg.hidden_size == 5120 and cfg.n_routed_experts == 384


def test_layers_of_one_kind_share_tensor_names_with_the_first_of_their_kind():
    cfg = synthetic.config(full_depth=True)
    alias = shared_layer_names(kinds.expected_tensors(cfg))
    owners = {int(name.split(".")[1]) for name in alias.values()}
    assert owners == {0, 2, 24}  # 1 and 14 (Engram tables of their own size) and 20 share with nobody
    assert alias["layers.8.attn.indexer.wq_b.weight"] == "layers.2.attn.indexer.wq_b.weight"
    assert alias["layers.39.ffn.experts.0.w1.weight"] == "layers.0.ffn.experts.0.w1.weight"  # reuse layer = SWA's
    assert not any(k.startswith(("layers.1.", "layers.14.")) for k in alias)


def test_shared_layers_hold_one_copy_of_weights_and_their_own_caches():
    model = synthetic.build_model(synthetic.config(NARROW, full_depth=True), "cpu", torch.float32, fp8_linears=False)
    assert model.config.num_hidden_layers == 40 and synthetic.config(NARROW, full_depth=True).num_hidden_layers == 40
    layers = model.layers
    assert layers[8].ffn.experts is layers[2].ffn.experts  # packed once (weights.arrange), not a stack per layer
    assert layers[8].attn.wq_a is layers[2].attn.wq_a and layers[39].attn.wq_a is layers[0].attn.wq_a
    assert layers[14].ffn.experts is not layers[2].ffn.experts
    assert layers[1].engram.embed is not layers[14].engram.embed
    pools = model.allocate_cache(num_slots=2, num_blocks=4)
    rings = {pools.window[i][0].data_ptr() for i in range(40)}
    assert len(rings) == 40  # every layer its own window ring


def test_the_synthetic_checkpoint_directory_loads_with_shared_dummy_weights(tmp_path):
    """tools/synthetic_checkpoint.py: config.json + tokenizer.json for the engine (model.path=...); with
    model.load_format=dummy_shared the layers of one kind share their tensors as build_model's do."""
    import sys
    from pathlib import Path

    from deepinfer.models import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import synthetic_checkpoint

    card = load_model(synthetic_checkpoint.write(tmp_path / "flash40", 40, True), weights=False,
                      load_format="dummy_shared")
    want = synthetic.config(synthetic.DSPARK_FLASH, full_depth=True)
    assert card.config.raw == want.raw and card.config.quantization.expert_dtype == "fp4"  # + the release's format
    narrow = synthetic_checkpoint.write(tmp_path / "narrow", 40, False, NARROW)
    model = load_model(narrow, load_format="dummy_shared", packed_experts=True, draft_layers=False)
    assert model.layers[8].ffn.experts is model.layers[2].ffn.experts
    plain = load_model(narrow, load_format="dummy", packed_experts=True, draft_layers=False)
    assert plain.layers[8].ffn.experts is not plain.layers[2].ffn.experts  # dummy draws every layer


def test_stored_experts_are_freed_as_they_are_stacked_and_the_stack_holds_their_values():
    """A model built from weights its caller gives up (synthetic.build_model, load_model) frees each stored expert
    tensor once it is stacked, so the stored and packed copies never coexist (a Flash layer's experts are ~7 GB:
    both copies of six kinds do not fit an 80 GB GPU); the stacks are those of a build that keeps its inputs."""
    from deepinfer.kernels.registry import OpSet
    from deepinfer.models.deepseek_v41 import DeepseekV41Model
    from deepinfer.models.random_weights import random_weights

    cfg = synthetic.config(dict(NARROW, engram_layer_ids=[]), full_depth=True)
    ops = OpSet.build("cpu")
    kept = random_weights(cfg, "cpu", torch.float32, 0, True, False, share_layers=True)
    given = random_weights(cfg, "cpu", torch.float32, 0, True, False, share_layers=True)
    a = DeepseekV41Model(cfg, kept, None, ops, "cpu", torch.float32)
    b = DeepseekV41Model(cfg, given, None, ops, "cpu", torch.float32, free_stored_experts=True)
    stored = [w for name, w in given.items() if ".ffn.experts." in name or ".ffn.shared_experts." in name]
    assert stored and all(w.weight.untyped_storage().nbytes() == 0 == w.scale.untyped_storage().nbytes()
                          for w in stored)
    assert all(w.weight.untyped_storage().nbytes() > 0 for name, w in kept.items() if ".ffn.experts." in name)
    for la, lb in zip(a.layers, b.layers):
        for f in ("w13", "s13", "w2", "s2"):
            assert torch.equal(getattr(la.ffn.experts, f), getattr(lb.ffn.experts, f))
        assert torch.equal(la.ffn.shared_experts.w13, lb.ffn.shared_experts.w13)
