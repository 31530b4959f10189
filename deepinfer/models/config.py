"""DeepSeek-V4.1 text-model configuration: parsed once from a Hugging Face `config.json`.

Accepts the composite `deepseek_v41` config (text settings under `text_config`, quantization at the
top level) and a flat text config (`deepseek_v41_text`). Missing derived fields are filled the way
the reference's config does (MODEL_V41_SPEC.md §1.2), then the layer schedule is validated.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ModelConfigError(ValueError):
    """A config.json the engine cannot serve; the message is one line naming the field."""


SUPPORTED_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
SUPPORTED_ARCHITECTURES = ("DeepseekV41ForCausalLM",)
RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20


@dataclass(frozen=True)
class QuantConfig:
    """The released checkpoint's storage format (top-level `quantization_config`)."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    activation_scheme: str = "dynamic"


@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    gate_temp: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnConfig | None
    max_position_embeddings: int
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 0
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    num_nextn_predict_layers: int = 0  # DSpark draft layers (mtp.*), MODEL_V41_SPEC.md §6
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 0  # filler of the block's non-anchor positions
    dspark_target_layer_ids: tuple[int, ...] = ()  # backbone layers whose attention-input streams feed the drafter
    dspark_markov_rank: int = 0  # 0: no Markov head
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = 2
    tie_word_embeddings: bool = False
    quantization: QuantConfig | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived views -------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def kv_source_of(self, layer: int) -> int | None:
        """Nearest KV-source layer at or before `layer` (whose compressed KV it reads)."""
        srcs = [s for s in self.kv_source_layer_ids if s <= layer]
        return srcs[-1] if srcs and self.compress_ratios[layer] > 0 else None

    # ---- parsing ------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"config.json not found at {path}") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        except RecursionError:
            raise ModelConfigError(f"{path} is nested too deeply to be a model config") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ModelConfigError(f"config.json: the top level is a {type(data).__name__}; allowed: a JSON object")
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"config.json: model_type={model_type!r} is not supported; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        archs = data.get("architectures")
        if archs and any(a not in SUPPORTED_ARCHITECTURES for a in archs):
            raise ModelConfigError(
                f"config.json: architectures={archs} is not supported; allowed: {list(SUPPORTED_ARCHITECTURES)}"
            )
        top = data
        text = dict(data.get("text_config") or data) if model_type == "deepseek_v41" else dict(data)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key not in text and key in top:
                text[key] = top[key]
        if not isinstance(text, dict):
            raise ModelConfigError(f"config.json: text_config is a {type(text).__name__}; allowed: a JSON object")
        _check_number_types(text)
        quant = _parse_quant(top.get("quantization_config") or text.get("quantization_config"))
        try:
            return _build(text, quant)
        except ModelConfigError:
            raise
        except (TypeError, ValueError, KeyError, IndexError) as exc:  # a field of a shape the checks above missed
            raise ModelConfigError(f"config.json: malformed field ({type(exc).__name__}: {exc})") from None


def _check_number_types(t: dict) -> None:
    """A numeric field holding a string, list or bool is named in one line (int("abc") would say nothing)."""
    hints = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    for key, value in t.items():
        kind = hints.get(key)
        if kind not in ("int", "float") or value is None:
            continue
        ok = type(value) is int or (kind == "float" and type(value) is float)
        if not ok:
            allowed = "an integer" if kind == "int" else "a number"
            raise ModelConfigError(f"config.json: {key}={value!r} has the wrong type; allowed: {allowed}")


# Sizes that must be positive for any model to exist; checked before the layer schedule, whose messages would
# otherwise describe the consequence (e.g. "allowed: 0..-2" for num_hidden_layers=-1) instead of the cause.
_AT_LEAST = {"vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 1,
             "q_lora_rank": 1, "o_groups": 1, "o_lora_rank": 1, "sliding_window": 1, "moe_intermediate_size": 1,
             "n_routed_experts": 1, "num_experts_per_tok": 1, "max_position_embeddings": 2}
# Loop counts and sizes a step or the load iterates over: far above any released value, low enough that a hostile
# config.json cannot hang the load (a Sinkhorn of 1e9 iterations) or ask for absurd tensors; every other integer
# field stays below 2**31.
_AT_MOST = {"hc_sinkhorn_iters": 1000, "hc_mult": 16, "engram_max_ngram_size": 16, "num_nextn_predict_layers": 16,
            "num_hidden_layers": 4096, "dspark_block_size": 64}
_INT_MAX = 2**31 - 1
_POSITIVE_FLOATS = ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "gate_temp",
                    "routed_scaling_factor")


def _parse_quant(q: dict | None) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method")
    block = tuple(q.get("weight_block_size") or (32, 32))
    checks = {
        "quant_method": (method, ("fp8",)),
        "weight_block_size": (list(block), ([32, 32],)),
        "scale_fmt": (q.get("scale_fmt", "ue8m0"), ("ue8m0",)),
        "expert_dtype": (q.get("expert_dtype", "fp4"), ("fp4", "fp8")),
        "activation_scheme": (q.get("activation_scheme", "dynamic"), ("dynamic",)),
        "fmt": (q.get("fmt", "e4m3"), ("e4m3",)),
    }
    for key, (value, allowed) in checks.items():
        if value not in allowed:
            raise ModelConfigError(
                f"quantization_config.{key}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}"
            )
    return QuantConfig(
        quant_method=method,
        weight_block_size=block,
        scale_fmt=q.get("scale_fmt", "ue8m0"),
        expert_dtype=q.get("expert_dtype", "fp4"),
        activation_scheme=q.get("activation_scheme", "dynamic"),
    )


def _derive_ratios(n: int) -> list[int]:
    if n == 40:
        return list(RELEASED_RATIOS)
    head = min(2, n)
    n2 = math.ceil((n - head) / 2)
    return [0] * head + [2] * n2 + [1] * (n - head - n2)


def _derive_sources(ratios: list[int]) -> list[int]:
    if ratios == RELEASED_RATIOS:
        return [2, 8, 14, 20]
    out, prev = [], 0
    for i, r in enumerate(ratios):
        if r > 0 and r != prev:
            out.append(i)
        prev = r
    return out


def _yarn(text: dict) -> YarnConfig | None:
    params = (text.get("rope_parameters") or {}).get("compress")
    scaling = params if params and params.get("rope_type") == "yarn" else text.get("rope_scaling")
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return None
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        v = scaling.get(key)
        if v not in (None, 1.0, 1, 0, 0.0) and key != "attention_factor":
            raise ModelConfigError(f"rope_scaling.{key}={v!r} is not supported; allowed: unset")
    if scaling.get("attention_factor", 1.0) != 1.0:
        raise ModelConfigError(f"rope_scaling.attention_factor={scaling['attention_factor']!r}; allowed: 1.0")
    return YarnConfig(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
    )


def _build(t: dict, quant: QuantConfig | None) -> ModelConfig:
    def need(key, *alts):
        for k in (key, *alts):
            if k in t and t[k] is not None:
                return t[k]
        raise ModelConfigError(f"config.json: required field {key!r} is missing")

    n = int(need("num_hidden_layers", "n_layers"))
    nextn = int(t.get("num_nextn_predict_layers", t.get("n_mtp_layers", 0)) or 0)
    ratios = list(t.get("compress_ratios") or _derive_ratios(n))
    if len(ratios) == n + nextn:
        ratios = ratios[:n]  # trailing entries describe the DSpark draft layers
    if len(ratios) < n:
        raise ModelConfigError(f"config.json: compress_ratios has {len(ratios)} entries, expected {n}")
    ratios = ratios[:n]
    kv_src = list(t.get("kv_source_layer_ids", t.get("kv_source_layers")) or _derive_sources(ratios))
    idx_src = t.get("index_source_layer_ids", t.get("index_source_layers"))
    if idx_src is None:
        idx_src = [2, 8, 14, 20, 24, 28, 32, 36] if kv_src == [2, 8, 14, 20] else list(kv_src)
    cand = t.get("candidate_source_layer_id", t.get("candidate_source_layer"))
    if cand is None:
        cand = kv_src[-1] if kv_src else -1
    if t.get("num_key_value_heads", 1) != 1:
        raise ModelConfigError(f"num_key_value_heads={t['num_key_value_heads']} is not supported; allowed: 1")
    if t.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={t['hidden_act']!r} is not supported; allowed: silu")
    scoring = t.get("scoring_func", t.get("score_func", "sqrtsoftplus"))
    if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ModelConfigError(f"scoring_func={scoring!r} is not supported; allowed: sqrtsoftplus, softmax, sigmoid")
    if t.get("attention_bias"):
        raise ModelConfigError("attention_bias=true is not supported; allowed: false")
    if not t.get("hc_shifted", True):
        raise ModelConfigError("hc_shifted=false is not supported; allowed: true")

    cfg = ModelConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size", "dim")),
        num_hidden_layers=n,
        num_attention_heads=int(need("num_attention_heads", "n_heads")),
        head_dim=int(need("head_dim")),
        qk_rope_head_dim=int(need("qk_rope_head_dim", "rope_head_dim")),
        q_lora_rank=int(need("q_lora_rank")),
        o_groups=int(need("o_groups")),
        o_lora_rank=int(need("o_lora_rank")),
        sliding_window=int(need("sliding_window", "window_size")),
        compress_ratios=tuple(int(r) for r in ratios),
        kv_source_layer_ids=tuple(kv_src),
        index_source_layer_ids=tuple(idx_src),
        candidate_source_layer_id=int(cand),
        candidate_topk_blocks=int(t.get("candidate_topk_blocks", 2048)),
        candidate_block_size=int(t.get("candidate_block_size", 8)),
        index_n_heads=int(t.get("index_n_heads", 32)),
        index_head_dim=int(t.get("index_head_dim", 128)),
        index_topk=int(t.get("index_topk", 512)),
        moe_intermediate_size=int(need("moe_intermediate_size", "moe_inter_dim")),
        n_routed_experts=int(need("n_routed_experts")),
        num_experts_per_tok=int(need("num_experts_per_tok", "n_activated_experts")),
        n_shared_experts=int(t.get("n_shared_experts", 1)),
        scoring_func=scoring,
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        routed_scaling_factor=float(t.get("routed_scaling_factor", t.get("route_scale", 1.0))),
        gate_temp=float(t.get("gate_temp", 1.0) or 1.0),
        swiglu_limit=float(t.get("swiglu_limit", 0.0) or 0.0),
        hc_mult=int(t.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(t.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(t.get("hc_eps", 1e-6)),
        rms_norm_eps=float(t.get("rms_norm_eps", t.get("norm_eps", 1e-6))),
        rope_theta=float(t.get("rope_theta", 10000.0)),
        compress_rope_theta=float(t.get("compress_rope_theta", 160000.0)),
        yarn=_yarn(t),
        max_position_embeddings=int(t.get("max_position_embeddings", 4096)),
        engram_layer_ids=tuple(t.get("engram_layer_ids") or ()),
        engram_vocab_size=int(t.get("engram_vocab_size", 0) or 0),
        engram_num_embeddings=tuple(t.get("engram_num_embeddings") or ()),
        engram_max_ngram_size=int(t.get("engram_max_ngram_size", 4)),
        engram_n_heads=int(t.get("engram_n_heads", 8)),
        engram_head_dim=int(t.get("engram_head_dim", 256)),
        engram_pad_id=int(t.get("engram_pad_id", t.get("engram_pad_token_id", 2))),
        engram_compressed_vocab_size=int(t.get("engram_compressed_vocab_size", 0) or 0),
        num_nextn_predict_layers=nextn,
        dspark_block_size=int(t.get("dspark_block_size", 5)),
        dspark_noise_token_id=int(t.get("dspark_noise_token_id", 0)),
        dspark_target_layer_ids=tuple(int(x) for x in (t.get("dspark_target_layer_ids")
                                                       or [i for i in range(n) if i not in kv_src][-3:])),
        dspark_markov_rank=int(t.get("dspark_markov_rank", 0) or 0),
        dspark_n_routed_experts=int(t.get("dspark_n_routed_experts") or need("n_routed_experts")),
        dspark_num_experts_per_tok=int(t.get("dspark_num_experts_per_tok", t.get("dspark_n_activated_experts"))
                                       or need("num_experts_per_tok", "n_activated_experts")),
        bos_token_id=t.get("bos_token_id", 0),
        eos_token_id=t.get("eos_token_id", 1),
        pad_token_id=t.get("pad_token_id", 2),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        quantization=quant,
        raw=t,
    )
    _validate(cfg)
    return cfg


def _check_numbers(c: ModelConfig) -> None:
    """Every number finite and bounded, the ones a step divides by or exponentiates positive."""
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ModelConfigError(f"config.json: {f.name}={value} is out of range; allowed: a finite number")
        if isinstance(value, int) and value > _AT_MOST.get(f.name, _INT_MAX):
            raise ModelConfigError(f"config.json: {f.name}={value} is out of range; allowed: "
                                   f"<= {_AT_MOST.get(f.name, _INT_MAX)}")
    for name in _POSITIVE_FLOATS:
        if not getattr(c, name) > 0:
            raise ModelConfigError(f"config.json: {name}={getattr(c, name)} is out of range; allowed: > 0")
    if c.rms_norm_eps >= 1:
        raise ModelConfigError(f"config.json: rms_norm_eps={c.rms_norm_eps} is out of range; allowed: (0, 1)")
    if c.swiglu_limit < 0:
        raise ModelConfigError(f"config.json: swiglu_limit={c.swiglu_limit} is out of range; allowed: >= 0 "
                               "(0: no limit)")


def _validate(c: ModelConfig) -> None:
    _check_numbers(c)
    for name, low in _AT_LEAST.items():
        if getattr(c, name) < low:
            raise ModelConfigError(f"config.json: {name}={getattr(c, name)} is out of range; allowed: >= {low}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ModelConfigError(
            f"config.json: num_experts_per_tok={c.num_experts_per_tok} is out of range; allowed: at most "
            f"n_routed_experts={c.n_routed_experts}"
        )
    n, r = c.num_hidden_layers, c.compress_ratios
    for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        for layer in getattr(c, name):
            if not 0 <= layer < n:
                raise ModelConfigError(f"{name} contains layer {layer}; allowed: 0..{n - 1}")
    for s in c.kv_source_layer_ids + c.index_source_layer_ids:
        if r[s] <= 0:
            raise ModelConfigError(f"layer {s} is a KV/index source but compress_ratios[{s}]=0; allowed: > 0")
    for s in c.index_source_layer_ids:
        if not any(k <= s for k in c.kv_source_layer_ids):
            raise ModelConfigError(f"index source layer {s} has no KV source at or before it")
    if c.candidate_source_layer_id >= 0 and c.candidate_source_layer_id not in c.index_source_layer_ids:
        raise ModelConfigError(
            f"candidate_source_layer_id={c.candidate_source_layer_id} must be one of index_source_layer_ids "
            f"{list(c.index_source_layer_ids)} (or -1)"
        )
    for i, ratio in enumerate(r):
        if ratio not in (0, 1, 2):
            raise ModelConfigError(f"compress_ratios[{i}]={ratio} is not supported; allowed: 0, 1, 2")
        if ratio > 0 and not any(k <= i for k in c.kv_source_layer_ids):
            raise ModelConfigError(f"layer {i} has compress ratio {ratio} but no KV source at or before it")
    if c.num_attention_heads * c.head_dim % c.o_groups:
        raise ModelConfigError(f"o_groups={c.o_groups} must divide num_attention_heads*head_dim")
    if c.num_nextn_predict_layers:
        for layer in c.dspark_target_layer_ids:
            if not 0 <= layer < n:
                raise ModelConfigError(f"dspark_target_layer_ids contains layer {layer}; allowed: 0..{n - 1}")
        if not 0 <= c.dspark_noise_token_id < c.vocab_size:
            raise ModelConfigError(f"dspark_noise_token_id={c.dspark_noise_token_id} is out of range; allowed: "
                                   f"[0, {c.vocab_size - 1}]")
        if not 1 <= c.dspark_num_experts_per_tok <= c.dspark_n_routed_experts:
            raise ModelConfigError(f"dspark_num_experts_per_tok={c.dspark_num_experts_per_tok}; allowed: "
                                   f"1..dspark_n_routed_experts={c.dspark_n_routed_experts}")
    if c.engram_layer_ids and len(c.engram_num_embeddings) != len(c.engram_layer_ids):
        raise ModelConfigError(
            f"engram_num_embeddings has {len(c.engram_num_embeddings)} entries; expected one per engram layer "
            f"({len(c.engram_layer_ids)})"
        )
