"""The embedded default model: deterministic, the released storage format, loadable, not degenerate."""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from deepinfer import embedded
from deepinfer.kernels.torch.quant import dequant_fp4_rows, dequant_fp8_blocks, e2m1_values
from deepinfer.models import ForwardBatch, load_model
from deepinfer.models.config import ModelConfig
from deepinfer.models.engram import engram_table_rows


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_CACHE_DIR", str(root))
    yield embedded.materialize("tiny-random")
    mp.undo()


def test_builds_into_the_cache_dir_and_reuses_it(built):
    path = built
    assert path.parent.name.startswith("cache") and path.name.startswith("tiny-random-v41-")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert embedded.materialize("tiny-random") == path and (path / "model.safetensors").stat().st_mtime_ns == before


def test_build_is_deterministic(tmp_path):
    embedded.write_checkpoint(tmp_path)
    digest = hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    again = tmp_path / "again"
    again.mkdir()
    embedded.write_checkpoint(again)
    assert hashlib.sha256((again / "model.safetensors").read_bytes()).hexdigest() == digest


def test_config_is_the_released_composite_format_with_every_layer_role(built):
    raw = json.loads((built / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and raw["dtype"] == "bfloat16"
    assert raw["quantization_config"]["weight_block_size"] == [32, 32]
    assert raw["quantization_config"]["expert_dtype"] == "fp4"
    c = ModelConfig.from_dict(raw)
    assert 64 <= c.hidden_size <= 128 and 6 <= c.num_hidden_layers <= 8
    assert c.compress_ratios.count(0) >= 1 and 2 in c.compress_ratios and 1 in c.compress_ratios
    ratio2_src = [s for s in c.kv_source_layer_ids if c.compress_ratios[s] == 2]
    ratio1_src = [s for s in c.kv_source_layer_ids if c.compress_ratios[s] == 1]
    assert ratio2_src and ratio1_src
    assert any(c.compress_ratios[i] == 2 and i not in c.kv_source_layer_ids for i in range(c.num_hidden_layers))
    reindex = [s for s in c.index_source_layer_ids if s not in c.kv_source_layer_ids]
    assert reindex, "a Reindex layer: an index source that is not a KV source"
    assert len(c.engram_layer_ids) == 2 and c.engram_compressed_vocab_size == 422
    assert list(c.engram_num_embeddings) == engram_table_rows(
        c.engram_vocab_size, 2, c.engram_max_ngram_size, c.engram_n_heads
    )
    assert c.hc_mult == 4 and c.index_n_heads == 16 and c.sliding_window == 16 and c.vocab_size == 528
    assert c.head_dim % 32 == 0 and c.index_head_dim % 32 == 0 and c.max_position_embeddings >= 4096


def test_engram_table_rows_match_the_fixture_rule():
    # tiny-engram-hc4: vocab 64, n-grams up to 3, 2 heads -> tables of 290 and 370 rows (sum of each layer's primes)
    assert engram_table_rows(64, 2, 3, 2) == [290, 370]


def test_weights_use_the_released_storage_dtypes(built):
    with safe_open(str(built / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    assert t["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.2.attn.wq_a.scale"].shape == (2, 4)  # [ceil(64/32), ceil(128/32)]
    assert t["layers.0.ffn.experts.3.w1.weight"].dtype == torch.int8
    assert t["layers.0.ffn.experts.3.w1.weight"].shape == (64, 64)  # [out, in/2]: two e2m1 codes a byte
    assert t["layers.0.ffn.experts.3.w1.scale"].shape == (64, 4)  # per row, per 32 input columns
    assert t["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.hc_attn_fn"].dtype == torch.float32 and t["layers.0.attn.attn_sink"].dtype == torch.float32
    assert t["embed.weight"].dtype == torch.bfloat16 and t["layers.2.attn.compressor.wgate.weight"].dtype == torch.bfloat16


def test_quantizers_follow_the_released_scale_rules():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * 0.05
    q, s = embedded.quantize_fp8_blocks(w)
    deq = dequant_fp8_blocks(q, s)  # the loader's formula: e4m3 value * 2^(scale byte - 127), 32x32 blocks
    assert ((deq - w).abs() <= w.abs() / 16 + 1e-9).all()  # e4m3 keeps 3 mantissa bits
    amax = w.view(2, 32, 3, 32).abs().amax(dim=(1, 3))
    scale = 2.0 ** (s.view(torch.uint8).float() - 127)
    assert ((amax / scale > 224) & (amax / scale <= 448)).all()  # the smallest power of two that fits 448

    q4, s4 = embedded.quantize_fp4_rows(w)
    deq4 = dequant_fp4_rows(q4, s4)  # low nibble = even column, per-row per-32-column scales
    row_scale = 2.0 ** (s4.view(torch.uint8).float() - 127).repeat_interleave(32, 1)
    assert set((deq4 / row_scale).abs().unique().tolist()) <= set(e2m1_values(torch.arange(8)).tolist())
    assert ((deq4 - w).abs() <= row_scale).all()  # within one step of the e2m1 grid (steps are at most 1.0)
    rows_amax = w.view(64, 3, 32).abs().amax(-1).repeat_interleave(32, 1)
    assert ((rows_amax / row_scale > 3) & (rows_amax / row_scale <= 6)).all()


def test_loads_through_the_checkpoint_loader_and_generates_varied_tokens(built):
    torch.set_num_threads(1)
    model = load_model(built)
    state = model.new_state()
    logits = model.forward(ForwardBatch([model.tokenizer.encode("def fibonacci(n):").ids], [state]))
    tokens = []
    for _ in range(24):
        tokens.append(int(logits[0].argmax()))
        logits = model.forward(ForwardBatch([[tokens[-1]]], [state]))
    assert len(set(tokens)) >= 12, tokens  # random weights, but no collapse onto a few tokens
    assert model.config.eos_token_id not in tokens[:8]
