"""The embedded models: small DeepSeek-V4.1-architecture checkpoints that run offline.

`embedded:tiny`, the default, is shipped in the package (deepinfer/assets/tiny-v41, ~5 MB): trained by
tools/train_default_model.py on the Python standard library, backbone and DSpark draft layers, in the released
format, with its own byte-level BPE (1536 ids, DeepSeek-V4.1's chat markers at 1520..1535). docs/training.md has
how it was trained and what it scores.

`embedded:tiny-random` is the test model (random weights, small enough that its 16-token window and compressed
layers are all exercised by short prompts). It is built, not shipped: deterministically (fixed seed, a CPU
generator, no other randomness) on first use into `$DEEPINFER_CACHE_DIR/tiny-random-v41-<hash>` (default
~/.cache/deepinfer), in the released storage format, so it goes through the same loader as a real checkpoint:
  - config.json: the composite `deepseek_v41` config with the top-level quantization_config;
  - FP8 e4m3 projections with one ue8m0 scale per 32x32 block; FP4 e2m1 routed experts (two codes per byte,
    low nibble = even column) with one ue8m0 scale per row and 32 columns; FP8 Engram tables with per-row,
    per-32-channel ue8m0 scales; F32 for the mHC parameters, attention sinks and router biases; BF16 for the rest;
  - tokenizer.json: the package's byte-level BPE (512 ids, BOS 0 / EOS 1 / PAD 2) plus DeepSeek-V4.1's chat special
    tokens at 512..527 (`<think>`, `</think>`, `<｜User｜>`, `<｜Assistant｜>`, `｜DSML｜`, ...: the spellings
    deepseek_recipe renders), so chat prompts render and encode on it offline (vocab 528).
The tensor list comes from the loader's own table (deepinfer.models.loading.expected_tensors), so the two cannot
disagree. The hash covers the config, the tokenizer, the seed and BUILD_VERSION: change any and a new directory
is built next to the old one.

`embedded:tiny-random-vision` is tiny-random plus a small random image path (deepinfer.models.vision.tiny), built
the same way: the test model for image input.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch

from deepinfer.config.hardware import cpu_threads

BUILD_VERSION = 1
SEED = 41
NAMES = ("tiny", "tiny-random", "tiny-random-vision")
TRAINED = "tiny-v41"  # deepinfer/assets/<this>: the shipped trained default

QUANTIZATION = {
    "quant_method": "fp8",
    "expert_dtype": "fp4",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}


def config_json() -> dict:
    from deepinfer.models.engram import engram_table_rows
    from deepinfer.models.tiny import TEXT_CONFIG

    text = dict(TEXT_CONFIG)
    text["engram_num_embeddings"] = engram_table_rows(
        text["engram_vocab_size"], len(text["engram_layer_ids"]), text["engram_max_ngram_size"], text["engram_n_heads"]
    )
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
        "quantization_config": dict(QUANTIZATION),
        "text_config": text,
    }


def tokenizer_bytes() -> bytes:
    return (resources.files("deepinfer.assets") / "tokenizer.json").read_bytes()


def cache_root() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE_DIR") or Path.home() / ".cache" / "deepinfer").expanduser()


def _builder(name: str):
    """(config.json, writer) of a built embedded model."""
    if name == "tiny-random-vision":
        from deepinfer.models.vision import tiny

        cfg = tiny.with_vision(config_json())

        def write(out: Path) -> None:
            write_release(out, cfg, tokenizer_bytes(), random_weights(cfg))
            tiny.add_vision_weights(out, cfg)

        return cfg, write
    return config_json(), write_checkpoint


def checkpoint_dir(name: str = "tiny-random") -> Path:
    digest = hashlib.sha256()
    digest.update(json.dumps(_builder(name)[0], sort_keys=True).encode())
    digest.update(tokenizer_bytes())
    digest.update(f"seed={SEED};version={BUILD_VERSION}".encode())
    return cache_root() / f"{name}-v41-{digest.hexdigest()[:12]}"


def materialize(name: str = "tiny") -> Path:
    """The embedded checkpoint's directory: the shipped one for `tiny`; `tiny-random` built first if it is not
    there yet (safe against a concurrent build: each builder writes a private directory and renames it into
    place; the first rename wins)."""
    if name not in NAMES:
        from deepinfer.config.errors import ConfigError

        raise ConfigError(f"model.path=embedded:{name} is not an embedded model; allowed: "
                          + ", ".join(f"embedded:{n}" for n in NAMES))
    if name == "tiny":
        return Path(str(resources.files("deepinfer.assets") / TRAINED))
    final = checkpoint_dir(name)
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        with cpu_threads(1):  # a few hundred tiny tensors: extra threads only add sync cost (10x on busy hosts)
            _builder(name)[1](tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first: its directory is identical
            if not (final / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_checkpoint(out: Path) -> None:
    cfg = config_json()
    write_release(out, cfg, tokenizer_bytes(), random_weights(cfg))


def write_release(out: Path, cfg: dict, tokenizer_json: bytes, weights: dict[str, torch.Tensor]) -> None:
    """Any V4.1 text checkpoint into `out` in the released layout: config.json, tokenizer.json and
    model.safetensors with `weights` (canonical name -> dense fp32 values) stored by `release_tensors`. The embedded
    random model and tools/train_default_model.py both write through here."""
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "tokenizer.json").write_bytes(tokenizer_json)
    save_file(release_tensors(cfg, weights), str(out / "model.safetensors"), metadata={"format": "pt"})


def random_weights(cfg: dict) -> dict[str, torch.Tensor]:
    """Dense random values for every tensor the config implies, drawn in sorted-name order from one seeded CPU
    generator."""
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.loading import tensors as kinds
    from deepinfer.models.random_weights import fixture_init

    model_cfg = ModelConfig.from_dict(cfg)
    out = {}
    # the draft layers draw from their own generator: adding them leaves the backbone's weights unchanged
    for seed, specs in ((SEED, kinds.expected_tensors(model_cfg, draft_layers=False)),
                        (SEED + 1, kinds.draft_tensors(model_cfg))):
        gen = torch.Generator().manual_seed(seed)
        out.update({name: fixture_init(name, spec.shape, model_cfg.hidden_size, gen) for name, spec in sorted(specs.items())})
    return out


def release_tensors(cfg: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense values -> the tensors a released checkpoint stores, by the loader's own table: FP8 e4m3 projections
    with 32x32 ue8m0 block scales, FP4 e2m1 experts with per-row ue8m0 scales per 32 columns, FP8 Engram rows, F32
    for the mHC parameters / sinks / router biases, BF16 for the rest. Every required tensor must be given at its
    logical shape (optional ones may be left out); anything else is an error, not silently dropped."""
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.loading import tensors as kinds
    from deepinfer.models.loading.names import keeps_float32, scale_sibling

    specs = kinds.expected_tensors(ModelConfig.from_dict(cfg))
    missing = sorted(n for n, s in specs.items() if n not in weights and not s.optional)
    unexpected = sorted(set(weights) - set(specs))
    if missing or unexpected:
        raise ValueError(f"release_tensors: missing {missing[:10]}, unexpected {unexpected[:10]}")
    out: dict[str, torch.Tensor] = {}
    for name, spec in sorted(specs.items()):
        if name not in weights:
            continue
        w = weights[name].detach().float().cpu()
        if tuple(w.shape) != tuple(spec.shape):
            raise ValueError(f"release_tensors: {name} has shape {tuple(w.shape)}, expected {spec.shape}")
        if kinds.FP4_ROWS in spec.allowed:
            out[name], out[scale_sibling(name)] = quantize_fp4_rows(w)
        elif kinds.FP8_BLOCK in spec.allowed:
            out[name], out[scale_sibling(name)] = quantize_fp8_blocks(w)
        elif kinds.FP8_ROWS in spec.allowed:
            out[name], out[scale_sibling(name)] = quantize_fp8_rows(w)
        else:
            out[name] = w if keeps_float32(name) else w.to(torch.bfloat16)
    return out


# ---- the released storage formats ---------------------------------------------------------------------------
def _ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> F8_E8M0 bytes (2^(b - 127))."""
    exponent = torch.log2(scale).round().to(torch.int32) + 127
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    from deepinfer.kernels.torch.quant import ceil_pow2

    # An all-zero block gets scale 1 (as the fixtures' quantizer does); otherwise the smallest 2^k >= amax/top.
    return torch.where(amax > 0, ceil_pow2(amax.clamp_min(1e-30) / top), torch.ones_like(amax))


def quantize_fp8_blocks(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    from deepinfer.kernels.torch.quant import FP8_MAX

    rows, cols = w.shape
    pr, pc = -(-rows // block) * block, -(-cols // block) * block
    padded = w.new_zeros(pr, pc, dtype=torch.float32)  # on w's device: training quantises in its forward
    padded[:rows, :cols] = w
    amax = padded.view(pr // block, block, pc // block, block).abs().amax(dim=(1, 3))
    scale = _pow2_scale(amax, FP8_MAX)
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), _ue8m0(scale)


def quantize_fp8_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    from deepinfer.kernels.torch.quant import FP8_MAX

    rows, cols = w.shape
    amax = w.view(rows, cols // block, block).abs().amax(-1)
    scale = _pow2_scale(amax, FP8_MAX)
    return (w / scale.repeat_interleave(block, 1)).to(torch.float8_e4m3fn), _ue8m0(scale)


def quantize_fp4_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    from deepinfer.kernels.torch.quant import FP4_MAX, e2m1_codes

    rows, cols = w.shape
    amax = w.view(rows, cols // block, block).abs().amax(-1)
    scale = _pow2_scale(amax, FP4_MAX)
    codes = e2m1_codes((w / scale.repeat_interleave(block, 1)).clamp(-FP4_MAX, FP4_MAX))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), _ue8m0(scale)
