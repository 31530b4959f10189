"""deepinfer.models.loading: fixtures load with the right names/shapes/values; bad checkpoints fail in one line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from deepinfer.models.loading import (
    DEFAULT_MODEL_ID,
    expected_tensors,
    load_checkpoint,
    resolve_model_dir,
)
from deepinfer.models.loading import materialize as materialize_mod
from loading_helpers import (
    ALL_FIXTURES,
    ENGRAM_FIXTURE,
    FLOAT_FIXTURE,
    QUANT_FIXTURE,
    copy_fixture,
    edit_config,
    edit_tensors,
    expect_error,
    read_tensors,
    write_tensors,
)

FP32_ONLY = ("hc_attn_fn", "hc_ffn_base", "attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl")


@pytest.fixture(scope="module")
def quant_ckpt():
    return load_checkpoint(QUANT_FIXTURE)


@pytest.fixture(scope="module")
def float_ckpt():
    return load_checkpoint(FLOAT_FIXTURE)


@pytest.fixture
def qdir(tmp_path):
    return copy_fixture(QUANT_FIXTURE, tmp_path / "ckpt")


# ---- the fixtures load -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ALL_FIXTURES, ids=lambda p: p.name)
def test_fixture_loads_with_expected_names_and_shapes(fixture):
    ckpt = load_checkpoint(fixture)
    expected = expected_tensors(ckpt.config)
    assert set(ckpt.weights) == set(expected)
    assert ckpt.skipped == []
    assert ckpt.tokenizer_path == fixture / "tokenizer.json"
    for name, t in ckpt.weights.items():
        assert tuple(t.shape) == expected[name].shape, name
        assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert not any(n.endswith(".scale") for n in ckpt.weights)
    # Stored names are already native: the fixture's float tensors come back unchanged.
    with safe_open(str(fixture / "model.safetensors"), "pt") as f:
        for name in ("embed.weight", "layers.0.hc_attn_fn", "layers.1.attn.attn_sink"):
            assert torch.equal(ckpt.weights[name], f.get_tensor(name).float())


def test_engram_fixture_tables_and_shapes():
    ckpt = load_checkpoint(ENGRAM_FIXTURE)
    w = ckpt.weights
    assert w["layers.1.engram.embed.weight"].shape == (290, 16)
    assert w["layers.4.engram.embed.weight"].shape == (370, 16)
    assert w["layers.1.engram.wkv.weight"].shape == (64 * 5, 2 * 2 * 16)
    assert w["layers.0.hc_attn_fn"].shape == (24, 256)
    assert "layers.7.attn.indexer.wq_b.weight" in w and "layers.7.attn.indexer.wk.weight" not in w
    assert "layers.2.attn.compressor.wgate.weight" in w and "layers.5.attn.compressor.wgate.weight" not in w


def _e4m3_f64(t: torch.Tensor) -> torch.Tensor:
    """Decode e4m3fn bytes by hand (sign, 4-bit exponent bias 7, 3-bit mantissa, subnormals) in float64."""
    b = t.view(torch.uint8).long()
    sign = torch.where(b >> 7 == 1, -1.0, 1.0).double()
    exp, man = (b >> 3) & 15, (b & 7).double()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).double())
    sub = man / 8 * 2.0**-6
    return sign * torch.where(exp == 0, sub, normal)


def _pow2_f64(scale: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, scale.view(torch.uint8).double() - 127)


def test_fp8_block_dequant_matches_hand_formula(quant_ckpt):
    with safe_open(str(QUANT_FIXTURE / "model.safetensors"), "pt") as f:
        for name in ("layers.0.attn.wq_b", "layers.1.attn.indexer.wq_b", "layers.3.ffn.shared_experts.w2"):
            q, s = f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.scale")
            rows, cols = q.shape
            r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
            hand = _e4m3_f64(q) * _pow2_f64(s)[r // 32, c // 32]
            assert torch.equal(quant_ckpt.weights[f"{name}.weight"].double(), hand), name


def test_fp4_expert_dequant_matches_hand_formula(quant_ckpt):
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    with safe_open(str(QUANT_FIXTURE / "model.safetensors"), "pt") as f:
        for name in ("layers.0.ffn.experts.0.w1", "layers.2.ffn.experts.5.w2", "layers.5.ffn.experts.7.w3"):
            packed, s = f.get_tensor(f"{name}.weight").view(torch.uint8).long(), f.get_tensor(f"{name}.scale")
            rows, half = packed.shape
            hand = torch.empty(rows, 2 * half, dtype=torch.float64)
            for col in range(2 * half):
                nib = (packed[:, col // 2] >> (4 * (col % 2))) & 15  # low nibble = even column
                val = lut[nib & 7] * torch.where(nib & 8 > 0, -1.0, 1.0).double()
                hand[:, col] = val * _pow2_f64(s)[:, col // 32]
            assert torch.equal(quant_ckpt.weights[f"{name}.weight"].double(), hand), name


def test_quantized_fixture_is_close_to_float_fixture(quant_ckpt, float_ckpt):
    assert set(quant_ckpt.weights) == set(float_ckpt.weights)

    def rel(name):
        a, b = float_ckpt.weights[name], quant_ckpt.weights[name]
        return ((a - b).norm() / a.norm()).item()

    assert rel("layers.0.attn.wq_a.weight") < 0.05  # fp8 e4m3: 3 mantissa bits
    assert rel("layers.3.attn.wo_a.weight") < 0.05
    assert rel("layers.1.ffn.experts.2.w1.weight") < 0.2  # fp4 e2m1
    assert rel("layers.4.ffn.experts.6.w2.weight") < 0.2
    assert rel("embed.weight") < 0.01  # bf16
    for name in ("layers.0.hc_attn_fn", "layers.2.attn.attn_sink", "layers.5.ffn.gate.bias"):
        assert torch.equal(float_ckpt.weights[name], quant_ckpt.weights[name])  # stored F32 in both


def test_chunked_materialization_is_identical(monkeypatch, quant_ckpt):
    # Tiny chunks force several row chunks per tensor (FP8 chunks stay 32-row aligned).
    monkeypatch.setattr(materialize_mod, "CHUNK_ELEMENTS", 64)
    chunked = load_checkpoint(QUANT_FIXTURE).weights
    for name, t in quant_ckpt.weights.items():
        assert torch.equal(chunked[name], t), name


def test_bf16_load_keeps_fp32_parameters(quant_ckpt):
    ckpt = load_checkpoint(QUANT_FIXTURE, dtype="bfloat16")
    for name, t in ckpt.weights.items():
        want = torch.float32 if name.endswith(FP32_ONLY) or "hc_" in name else torch.bfloat16
        assert t.dtype == want, name
    name = "layers.0.attn.wq_a.weight"
    assert torch.equal(ckpt.weights[name], quant_ckpt.weights[name].bfloat16())


def _quantize_rows_fp8(w: torch.Tensor):
    """Per-row ue8m0 scale over the (<= 32) channels of a tiny Engram table, e4m3 values: the release format."""
    exp = torch.ceil(torch.log2(w.abs().amax(1, keepdim=True).clamp_min(1e-30) / 448))
    q = (w / torch.exp2(exp)).to(torch.float8_e4m3fn)
    return q, (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_fp8_engram_table_is_dequantized_per_row(tmp_path):
    d = copy_fixture(ENGRAM_FIXTURE, tmp_path / "ckpt")
    name = "layers.1.engram.embed"
    original = read_tensors(d)[f"{name}.weight"]
    q, s = _quantize_rows_fp8(original)
    edit_tensors(d, lambda t: t.update({f"{name}.weight": q, f"{name}.scale": s}))
    got = load_checkpoint(d).weights[f"{name}.weight"]
    assert got.shape == original.shape == (290, 16)
    assert torch.equal(got.double(), _e4m3_f64(q) * _pow2_f64(s))  # one scale per row (16 channels < 32)
    assert ((got - original).norm() / original.norm()).item() < 0.05
    edit_tensors(d, lambda t: t.__setitem__(f"{name}.scale", torch.cat([s, s], 1)))
    expect_error(lambda: load_checkpoint(d), f"{name}.scale", "[290, 2]", "[290, 1]")


def test_tied_embeddings_may_omit_head(tmp_path):
    d = copy_fixture(FLOAT_FIXTURE, tmp_path / "ckpt")
    edit_tensors(d, lambda t: t.pop("head.weight"))
    expect_error(lambda: load_checkpoint(d), "missing", "head.weight")
    edit_config(d, lambda c: c["text_config"].update(tie_word_embeddings=True))
    w = load_checkpoint(d).weights
    assert w["head.weight"] is w["embed.weight"]


# ---- name and layout variants -----------------------------------------------------------------------------------
def test_model_prefix_and_lm_head_names_load(qdir, quant_ckpt):
    def rename(t):
        for k in list(t):
            t["lm_head.weight" if k == "head.weight" else "model." + k] = t.pop(k)

    edit_tensors(qdir, rename)
    ckpt = load_checkpoint(qdir)
    assert set(ckpt.weights) == set(quant_ckpt.weights)
    assert torch.equal(ckpt.weights["head.weight"], quant_ckpt.weights["head.weight"])


def test_head_and_lm_head_together_is_ambiguous(qdir):
    edit_tensors(qdir, lambda t: t.__setitem__("lm_head.weight", t["head.weight"].clone()))
    expect_error(lambda: load_checkpoint(qdir), "lm_head.weight", "head.weight")


def test_sharded_index_loads(qdir, quant_ckpt):
    tensors = read_tensors(qdir)
    (qdir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        write_tensors(qdir, {k: tensors[k] for k in part}, file)
        weight_map.update({k: file for k in part})
    (qdir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ckpt = load_checkpoint(qdir)
    for name, t in quant_ckpt.weights.items():
        assert torch.equal(ckpt.weights[name], t), name


def test_index_with_missing_shard_fails(qdir):
    (qdir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"embed.weight": "model-00001-of-00002.safetensors"}})
    )
    expect_error(lambda: load_checkpoint(qdir), "model-00001-of-00002.safetensors")


def test_flat_text_config_loads(qdir):
    def flatten(cfg):
        text = cfg.pop("text_config")
        text["quantization_config"] = cfg["quantization_config"]
        cfg.clear()
        cfg.update(text, architectures=["DeepseekV41ForCausalLM"])

    edit_config(qdir, flatten)
    assert load_checkpoint(qdir).config.hidden_size == 64


def test_mtp_and_vision_tensors_are_set_aside(qdir, caplog, quant_ckpt):
    def add(t):
        t["mtp.0.attn.wq_a.weight"] = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
        t["mtp.0.attn.wq_a.scale"] = torch.zeros(1, 2, dtype=torch.float8_e8m0fnu)
        t["mtp.2.markov_head.embed.weight"] = torch.zeros(512, 8, dtype=torch.bfloat16)
        t["vision.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
        t["aligner.proj.weight"] = torch.zeros(4, 4)
        t["image_newline"] = torch.zeros(64)

    edit_tensors(qdir, add)
    with caplog.at_level(logging.INFO, logger="deepinfer.loading"):
        ckpt = load_checkpoint(qdir)
    assert ckpt.skipped == sorted(ckpt.skipped) and len(ckpt.skipped) == 6
    assert "mtp.0.attn.wq_a.scale" in ckpt.skipped and "image_newline" in ckpt.skipped
    assert set(ckpt.weights) == set(quant_ckpt.weights)
    lines = [r for r in caplog.records if r.name == "deepinfer.loading"]
    assert len(lines) == 1 and "mtp.*" in lines[0].getMessage() and "vision.*" in lines[0].getMessage()


# ---- bad checkpoints: one-line CheckpointError naming the culprit ------------------------------------------------
def test_missing_tensor(qdir):
    edit_tensors(qdir, lambda t: t.pop("layers.2.attn.wo_b.weight"))
    msg = expect_error(lambda: load_checkpoint(qdir), str(qdir), "missing", "layers.2.attn.wo_b.weight")
    assert "unexpected" not in msg  # the orphaned .scale is explained by the missing weight


def test_many_missing_tensors_are_summarised(qdir):
    edit_tensors(qdir, lambda t: [t.pop(k) for k in list(t) if k.startswith("layers.5.")])
    msg = expect_error(lambda: load_checkpoint(qdir), "missing", "and ", "more")
    assert msg.count("layers.5.") == 10


def test_unexpected_tensor(qdir):
    edit_tensors(qdir, lambda t: t.__setitem__("layers.0.attn.surprise.weight", torch.zeros(3)))
    expect_error(lambda: load_checkpoint(qdir), "unexpected", "layers.0.attn.surprise.weight")


def test_wrong_shape(qdir):
    edit_tensors(qdir, lambda t: t.__setitem__("layers.1.attn_norm.weight", torch.ones(60, dtype=torch.bfloat16)))
    expect_error(lambda: load_checkpoint(qdir), "layers.1.attn_norm.weight", "[60]", "[64]")


def test_wrong_quantized_shape(qdir):
    name = "layers.0.attn.wq_a.weight"
    edit_tensors(qdir, lambda t: t.__setitem__(name, t[name][:, :32]))
    expect_error(lambda: load_checkpoint(qdir), "layers.0.attn.wq_a.weight", "[32, 32]", "[32, 64]")


def test_wrong_scale_shape(qdir):
    name = "layers.0.ffn.experts.1.w2.scale"
    edit_tensors(qdir, lambda t: t.__setitem__(name, t[name][:, :0]))
    expect_error(lambda: load_checkpoint(qdir), "layers.0.ffn.experts.1.w2.scale", "[64, 0]", "[64, 1]")


def test_missing_scale(qdir):
    edit_tensors(qdir, lambda t: t.pop("layers.3.attn.wkv.scale"))
    expect_error(lambda: load_checkpoint(qdir), "layers.3.attn.wkv.scale", "missing")


def test_wrong_dtype(qdir):
    edit_tensors(qdir, lambda t: t.__setitem__("layers.0.ffn_norm.weight", torch.ones(64, dtype=torch.int32)))
    expect_error(lambda: load_checkpoint(qdir), "layers.0.ffn_norm.weight", "I32", "F32/BF16/F16")


def test_quantized_dtype_on_a_dense_only_tensor(qdir):
    name = "layers.0.ffn.gate.weight"
    edit_tensors(qdir, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    expect_error(lambda: load_checkpoint(qdir), "layers.0.ffn.gate.weight", "F8_E4M3", "expected F32/BF16/F16")


def test_truncated_safetensors(qdir):
    data = (qdir / "model.safetensors").read_bytes()
    (qdir / "model.safetensors").write_bytes(data[: len(data) - 1000])
    expect_error(lambda: load_checkpoint(qdir), "model.safetensors", "truncated")


def test_garbage_safetensors(qdir):
    (qdir / "model.safetensors").write_bytes(b"\x00" * 4 + b"not a safetensors file" * 10)
    expect_error(lambda: load_checkpoint(qdir), "model.safetensors")


def test_unsupported_model_type(qdir):
    edit_config(qdir, lambda c: c.update(model_type="llama"))
    expect_error(lambda: load_checkpoint(qdir), "model_type", "llama")


def test_unsupported_architecture(qdir):
    edit_config(qdir, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    expect_error(lambda: load_checkpoint(qdir), "architectures", "LlamaForCausalLM")


def test_unsupported_block_size(qdir):
    edit_config(qdir, lambda c: c["quantization_config"].update(weight_block_size=[128, 128]))
    expect_error(lambda: load_checkpoint(qdir), "weight_block_size", "128")


def test_missing_tokenizer(qdir):
    (qdir / "tokenizer.json").unlink()
    expect_error(lambda: load_checkpoint(qdir), "tokenizer.json")


def test_missing_config(qdir):
    (qdir / "config.json").unlink()
    expect_error(lambda: load_checkpoint(qdir), "config.json")


def test_pickle_only_checkpoint_is_refused(qdir):
    (qdir / "model.safetensors").unlink()
    (qdir / "pytorch_model.bin").write_bytes(b"not unpickled")
    expect_error(lambda: load_checkpoint(qdir), "pytorch_model.bin", "safetensors")


def test_missing_directory(tmp_path):
    expect_error(lambda: load_checkpoint(tmp_path / "nope"), "nope")


# ---- resolving a model reference --------------------------------------------------------------------------------
def test_local_path_is_used_directly(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    assert resolve_model_dir(str(QUANT_FIXTURE)) == QUANT_FIXTURE
    assert resolve_model_dir(QUANT_FIXTURE) == QUANT_FIXTURE


def test_env_model_dir_replaces_hub_download(monkeypatch):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(QUANT_FIXTURE))
    assert resolve_model_dir(DEFAULT_MODEL_ID) == QUANT_FIXTURE
    assert resolve_model_dir(None) == QUANT_FIXTURE
    assert resolve_model_dir("some-org/another-model") == QUANT_FIXTURE


def test_env_model_dir_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "missing"))
    expect_error(lambda: resolve_model_dir(DEFAULT_MODEL_ID), "DEEPINFER_HF_MODEL_DIR")


def test_offline_unknown_hub_id_fails_in_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    expect_error(lambda: resolve_model_dir("deepinfer-tests/no-such-model"), "deepinfer-tests/no-such-model", "offline")


def test_not_a_path_nor_hub_id(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    expect_error(lambda: resolve_model_dir(str(tmp_path / "a" / "b")), "neither")
    expect_error(lambda: resolve_model_dir(tmp_path / "gone"), "does not exist")
