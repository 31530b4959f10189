"""load_checkpoint: config + tokenizer path + dense, canonically named weights of a local checkpoint directory."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.config.schema import LOAD_FORMATS
from deepinfer.kernels.fp8_weight import Fp8BlockWeight, from_stored
from deepinfer.kernels.packed_experts import QuantizedWeight
from deepinfer.models.config import ModelConfig, ModelConfigError

from .errors import CheckpointError
from .materialize import materialize
from .names import canonical_name, is_image_path, is_set_aside, keeps_float32, set_aside_group
from .plan import natural_key, plan_load
from .safetensors_reader import SafetensorsFiles, StoredTensor
from .tensors import FP4_ROWS, FP8_BLOCK, FP8_ROWS, expected_tensors

log = logging.getLogger("deepinfer.loading")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # canonical names, dense, dequantized
    tokenizer_path: Path
    skipped: list[str] = field(default_factory=list)  # set-aside names (mtp.*, vision.*, aligner.*, image_*)
    model_dir: Path | None = None


def load_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    weights: bool = True,
    quantized_experts: bool = False,
    quantized_linears: bool = False,
    draft_layers: bool = True,
    load_format: str = "auto",
    tokenizer: str | Path | None = None,
    routed_experts: Collection[int] | None = None,
    engram_host: bool = False,
) -> Checkpoint:
    """Load a local Hugging Face checkpoint directory (use resolve_model_dir first for hub ids).

    Every check that needs only headers (config, tokenizer, files, names, dtypes, shapes) runs before any weight
    is read. Quantized weights come back dequantized; float tensors are cast to `dtype` except the float32-only
    parameters (hc_*, attn.attn_sink, ffn.gate.bias/bias_vl). With `weights=False` only those checks run and
    `Checkpoint.weights` stays empty (a frontend whose engine process holds the weights). With
    `quantized_experts`, routed and shared expert weights stored as FP4 / FP8 (32x32 blocks) come back as they are
    stored (`QuantizedWeight`), for the model to pack once (deepinfer.kernels.packed_experts). With
    `quantized_linears`, the other FP8 (32x32 block) projections come back as stored too (`Fp8BlockWeight`,
    deepinfer.kernels.fp8_weight): 1 byte per weight instead of 2 in bf16. With `draft_layers` (and a config that
    has them) the DSpark draft layers `mtp.*` are loaded too; otherwise they are set aside.

    `load_format="dummy"`: no weight file is opened (the directory needs only config.json and a tokenizer);
    `Checkpoint.weights` stays empty for the caller to fill with random weights (deepinfer.models.synthetic).
    `tokenizer`: a tokenizer.json file, or a directory holding one, instead of the checkpoint's own; its vocabulary
    must fit the config (vocab_size, and the Engram layers' normalised vocabulary).

    `routed_experts` (expert parallelism: the logical experts one rank's physical slots hold): of the backbone's
    routed experts (`layers.*.ffn.experts.<e>.*`) only these ids are read; the others stay in the files (their
    headers are still checked) and are absent from `Checkpoint.weights`. Everything else, shared experts and the
    draft layers' experts included, loads in full. None: every expert.

    `engram_host` (model.engram_storage=host): the Engram tables go to host memory as stored, never to `device`
    (pinned when it is CUDA; deepinfer.models.engram_host.HostTable): FP8 rows as their codes and scales, a float
    table in `dtype`, row chunk by row chunk (no second host copy of a ~100 GB table).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist (hub ids go through resolve_model_dir)")
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"model.load_format={load_format!r} is not supported; allowed: {', '.join(LOAD_FORMATS)}")
    dtype = _as_dtype(dtype)
    device = torch.device(device)
    cfg = read_config(model_dir)
    if tokenizer is None:
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise CheckpointError(f"{model_dir}: tokenizer.json is missing (the fast-tokenizer file is required)")
        _check_tokenizer(tokenizer_path)
    else:
        tokenizer_path = tokenizer_file(tokenizer)
        _check_tokenizer_fits(cfg, tokenizer_path, _check_tokenizer(tokenizer_path))
    if load_format.startswith("dummy"):
        return Checkpoint(cfg, {}, tokenizer_path, [], model_dir)
    block = tuple(cfg.quantization.weight_block_size) if cfg.quantization else (32, 32)

    with SafetensorsFiles(model_dir) as files:
        drafts = draft_layers and cfg.num_nextn_predict_layers > 0
        stored, skipped = _canonicalize(files.tensors, keep=("mtp",) if drafts else ())
        items = plan_load(expected_tensors(cfg, drafts), stored, block, where=str(model_dir))
        if routed_experts is not None:
            keep = set(routed_experts)
            items = [it for it in items if (m := _ROUTED.match(it.name)) is None or int(m.group(1)) in keep]
        loaded = {}
        for item in items if weights else ():
            if engram_host and item.name.endswith("engram.embed.weight"):
                loaded[item.name] = _host_table(files, item, dtype, device, block)
                continue
            if quantized_experts and _keeps_format(item, block):
                loaded[item.name] = _stored(files, item, device)
                continue
            if quantized_linears and _is_fp8_linear(item, block):
                loaded[item.name] = _stored_fp8_linear(files, item, device)
                continue
            target = torch.float32 if keeps_float32(item.name) else dtype
            loaded[item.name] = materialize(files, item, target, device, block)

    if weights and "head.weight" not in loaded:  # only reachable for tie_word_embeddings=true (see expected_tensors)
        loaded["head.weight"] = loaded["embed.weight"]
    # the image path (vision.*, aligner.*, image_*) is loaded by models/vision when config.json has a vision_config
    aside = [n for n in skipped if not (isinstance(cfg.raw.get("vision_config"), dict) and is_image_path(n))]
    if aside:
        groups = Counter(set_aside_group(n) for n in aside)
        summary = ", ".join(f"{g} ({c})" for g, c in sorted(groups.items()))
        log.info("set aside %d checkpoint tensors the text model does not use: %s", len(aside), summary)
    log.debug("loaded %d tensors from %s", len(loaded), model_dir)
    return Checkpoint(cfg, loaded, tokenizer_path, skipped, model_dir)


_ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.(\d+)\.")  # a backbone routed expert's tensors


def _keeps_format(item, block) -> bool:
    expert = ".ffn.experts." in item.name or ".ffn.shared_experts." in item.name
    return expert and (item.kind == FP4_ROWS or (item.kind == FP8_BLOCK and tuple(block) == (32, 32)))


def _is_fp8_linear(item, block) -> bool:
    """An FP8 block-scaled projection other than an expert's (those follow `quantized_experts`)."""
    expert = ".ffn.experts." in item.name or ".ffn.shared_experts." in item.name
    return not expert and item.kind == FP8_BLOCK and tuple(block) == (32, 32)


def _stored_fp8_linear(files: SafetensorsFiles, item, device) -> Fp8BlockWeight:
    return from_stored(files.rows(item.weight).to(device), files.rows(item.scale).to(device))


def _stored(files: SafetensorsFiles, item, device) -> QuantizedWeight:
    def raw(t):
        return files.rows(t).contiguous().view(torch.uint8).to(device)

    return QuantizedWeight("fp4" if item.kind == FP4_ROWS else "fp8", raw(item.weight), raw(item.scale), item.shape)


def _host_table(files: SafetensorsFiles, item, dtype, device, block):
    """An Engram table in host memory as stored (pinned for a CUDA device): FP8 rows as codes + scales, else its
    values in `dtype` (materialize, chunked, checked finite)."""
    from deepinfer.models.engram_host import CHUNK_ROWS, HostTable

    pin = device.type == "cuda"
    if item.kind != FP8_ROWS:
        return HostTable(materialize(files, item, dtype, torch.device("cpu"), block, pin_memory=pin))

    def raw(t):
        out = torch.empty(t.shape, dtype=torch.uint8, pin_memory=pin)
        for start in range(0, t.shape[0], CHUNK_ROWS):
            out[start: start + CHUNK_ROWS].copy_(files.rows(t, start, min(t.shape[0], start + CHUNK_ROWS))
                                                 .contiguous().view(torch.uint8))
        return out

    return HostTable(raw(item.weight), raw(item.scale))


def _check_tokenizer(path: Path):
    """Parsed once here so a corrupt file is one line naming it (the model's loader would raise tokenizers' bare
    `Exception`); ~0.1 s for a 128k-token vocabulary."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception
        raise CheckpointError(f"{path}: not a valid tokenizer.json ({' '.join(str(exc).split())})") from None


def tokenizer_file(tokenizer: str | Path) -> Path:
    """model.tokenizer -> its tokenizer.json: the file itself, or the one in the directory it names."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"model.tokenizer={str(tokenizer)!r}: {path} does not exist; allowed: null (the "
                              f"checkpoint's tokenizer.json), a tokenizer.json file or a directory holding one")
    return path


def _check_tokenizer_fits(cfg: ModelConfig, path: Path, tok) -> None:
    """Another tokenizer than the checkpoint's must produce ids the model embeds, and (with Engram layers) the
    normalised vocabulary the hash tables were sized for: otherwise prompts index past the embedding or the hash
    addresses the wrong rows."""
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise CheckpointError(
            f"model.tokenizer={str(path)!r}: its vocabulary has {size} tokens but the model's vocab_size is "
            f"{cfg.vocab_size} (config.json); allowed: a tokenizer of at most {cfg.vocab_size} tokens")
    if cfg.engram_layer_ids:
        from deepinfer.models.engram import compressed_token_map

        _, compressed = compressed_token_map(tok)
        if compressed != cfg.engram_compressed_vocab_size:
            raise CheckpointError(
                f"model.tokenizer={str(path)!r}: its normalised vocabulary has {compressed} entries ({size} tokens) "
                f"but the model's Engram tables are sized for engram_compressed_vocab_size="
                f"{cfg.engram_compressed_vocab_size} (config.json, vocab_size {cfg.vocab_size}); allowed: a "
                f"tokenizer with the vocabulary the model was trained with")


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: config.json is missing")
    try:
        return ModelConfig.from_file(path)
    except ModelConfigError as exc:
        # ModelConfig messages may already start with "config.json:"; name the full path once instead.
        raise CheckpointError(f"{path}: {str(exc).removeprefix('config.json: ')}") from None


def _canonicalize(tensors: dict[str, StoredTensor], keep=()) -> tuple[dict[str, StoredTensor], list[str]]:
    """Canonical name -> header, plus the sorted set-aside names (except the roots in `keep`, e.g. "mtp" when the
    draft layers are loaded). Two stored names for one canonical name (e.g. `head.weight` and `lm_head.weight`)
    are ambiguous and refused."""
    out: dict[str, StoredTensor] = {}
    skipped: list[str] = []
    for key, entry in tensors.items():
        name = canonical_name(key)
        if is_set_aside(name) and name.split(".", 1)[0] not in keep:
            skipped.append(name)
            continue
        if name in out:
            raise CheckpointError(f"tensors {out[name].key!r} and {key!r} both map to {name!r}; keep only one")
        out[name] = entry
    return out, sorted(skipped, key=natural_key)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.").lower()
        if key not in _DTYPES:
            raise CheckpointError(f"dtype={dtype!r} is not supported; allowed: {', '.join(sorted(_DTYPES))}")
        return _DTYPES[key]
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"dtype={dtype!r} is not supported; allowed: a floating torch.dtype")
    return dtype
