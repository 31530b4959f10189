"""DeepInfer's `deepinfer.entrypoints.llm.LLM`, as a drop-in over deepinfer.LLM: DeepInfer's argument names and
defaults, mapped onto this engine's config, and its return values (strings with decode_sequence=True, per-token
outputs with False; a failed request is an empty string and one logged line, the others return).

    from deepinfer.entrypoints.llm import LLM
    from deepinfer.sampling_params import SamplingParams
    llm = LLM(model="path/or/hub-id", expert_parallel_size=1, gpu_memory_utilization=0.9)
    texts = llm.generate(prompts, SamplingParams(temperature=0.6, max_tokens=64))   # list[str]

Each argument either changes the config (the table in docs/python-api.md, "DeepInfer's Python API"), is one of
DeepInfer's EngineArgs that has nothing to act on here (INERT: accepted with a one-line warning saying what it does
there), or is refused with a one-line ConfigError naming what is allowed. Keyword arguments of deepinfer.LLM
(hardware=, process=, engine={...}, overrides=[...]) pass through. As DeepInfer, DSpark runs by default when the
checkpoint has draft layers (DEEPINFER_USE_NEXTN_DECODE drafts, 5 unless set; 0 turns drafting off;
DEEPINFER_ENABLE_MTP_VARLEN its confidence scheduling).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from deepinfer.api import LLM as _LLM
from deepinfer.api import _value, load_settings, overrides_for
from deepinfer.config.errors import ConfigError
from deepinfer.config.schema import LOAD_FORMATS
from deepinfer.entrypoints.token_outputs import TokenOutput, per_token

__all__ = ["LLM"]

log = logging.getLogger("deepinfer")

# DeepInfer's EngineArgs with nothing to act on in this engine: what each does in DeepInfer
INERT = {
    "disable_log_stats": "turns off its engine's periodic stats log (this engine logs none)",
    "served_model_name": "names the model in its API server's responses (an offline LLM has none; the server's "
                         "is serve.served_model_name)",
    "tokens_per_block": "asserts the KV block size it derives from the model (the block layout here is its own)",
    "lookahead_tokens": "reserves extra cache tokens per sequence (this engine sizes DSpark's itself)",
    "stop_preempted_request": "ends a preempted request instead of recomputing it (this engine recomputes, as "
                              "DeepInfer's LLM does by default)",
    "engine_type": "picks a prompt-only or completion-only engine for disaggregated serving (one engine here)",
    "engine_rank": "numbers this engine in a multi-engine deployment",
    "engine_group_rank": "numbers this engine's group in a multi-engine deployment",
    "engram_parallel_size": "shards the Engram tables over ranks (they are replicated here)",
    "ignore_len": "bounds the prompt length it accepts (engine.max_model_len bounds it here)",
    "offline_inference": "marks its engine as offline (the LLM is)",
}


def _model_config(path: str, weights: bool = True):
    """The model's config.json, read before anything loads (weights=False, load_format dummy: a hub id downloads
    only its config and tokenizer)."""
    from deepinfer.models.loading import resolve_model_dir
    from deepinfer.pipeline.build import model_location

    from deepinfer.models.config import ModelConfig

    model_dir = resolve_model_dir(model_location(path), weights=weights)
    return ModelConfig.from_file(Path(model_dir) / "config.json")


def _warn_inert(args: dict) -> None:
    for name, value in args.items():
        log.warning("LLM(%s=%r) has no effect here: in DeepInfer it %s", name, value, INERT[name])


def _has_draft_layers(overrides: list[str]) -> bool:
    """Whether the model these overrides name has DSpark draft layers (read from its config.json after composing
    only: no resolve step, so no warning about DSpark's variables is given before decoding is chosen). Any error
    here is left to load_settings and the loader, which report it."""
    from deepinfer.config.compose import compose

    try:
        cfg = compose(overrides)
        return bool(_model_config(str(cfg.model.path), weights=cfg.model.load_format == "auto")
                    .num_nextn_predict_layers)
    except Exception:
        return False


def _decoding_chosen(overrides, ours: dict) -> bool:
    return "decoding" in ours or any(str(o).split("=", 1)[0].lstrip("+~") == "decoding" for o in overrides)


def _parallel_overrides(ep, dp, cp, ours: dict) -> list[str]:
    """DeepInfer's sizes as config overrides (the resolve step checks them: EP divides CP x DP; data_parallel_size
    0 is EP / CP there). One rank: none. `expert_parallel_size=N` alone: the dep<N> layout when conf/parallel has
    it. Otherwise the dep2 file (it reads the EPLB and timeout variables) with the three sizes set."""
    from deepinfer.config.compose import group_options

    sizes = {"expert_parallel_size": ep, "data_parallel_size": dp, "context_parallel_size": cp}
    for name, value in sizes.items():
        low = 0 if name == "data_parallel_size" else 1
        if type(value) is not int or value < low:
            raise ConfigError(f"LLM({name}={value!r}) is not allowed; allowed: an integer >= {low}")
    if ep == 1 and cp == 1 and dp in (0, 1):
        return []
    if "parallel" in ours:
        raise ConfigError(f"LLM(parallel={ours['parallel']!r}) with expert/data/context_parallel_size: allowed: one "
                          "of the two ways to choose the layout")
    if cp == 1 and dp in (0, ep) and f"dep{ep}" in group_options("parallel"):
        return [f"parallel=dep{ep}"]
    return ["parallel=dep2", f"parallel.name=ep{ep}_dp{dp}_cp{cp}", f"parallel.expert_parallel_size={ep}",
            f"parallel.data_parallel_size={dp}", f"parallel.context_parallel_size={cp}"]


def _images_refused(model_dir: str) -> str:
    """Why generate(multi_modal_data=...) is refused by a model without an image path."""
    try:
        has_config = isinstance(json.loads((Path(model_dir) / "config.json").read_text()).get("vision_config"), dict)
    except (OSError, ValueError):
        has_config = False
    why = ("its checkpoint holds no vision.* / aligner.* / image_* tensors" if has_config
           else "no vision_config in its config.json")
    return f"generate(multi_modal_data=...): this model has no vision tower ({why}); allowed: None"


class LLM(AbstractContextManager):
    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        expert_parallel_size: int = 1,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        decode_sequence: bool = True,
        *,
        data_parallel_size: int = 0,
        context_parallel_size: int = 1,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        chunked_prefill: bool = False,
        load_format: str = "auto",
        **ours: Any,
    ) -> None:
        _warn_inert({k: ours.pop(k) for k in list(ours) if k in INERT})
        if trust_remote_code:
            raise ConfigError("LLM(trust_remote_code=True): this engine runs no code from a checkpoint (the "
                              "DeepSeek-V4.1 model is built in); allowed: False")
        for name, value in (("revision", revision), ("tokenizer_revision", tokenizer_revision)):
            if value is not None:
                raise ConfigError(f"LLM({name}={value!r}): pinned hub revisions are not available yet; allowed: None "
                                  f"(download the revision and pass its directory as model)")
        layout = _parallel_overrides(expert_parallel_size, data_parallel_size, context_parallel_size, ours)
        if not isinstance(load_format, str) or load_format.lower() not in LOAD_FORMATS:
            raise ConfigError(f"LLM(load_format={load_format!r}) is not supported; allowed: "
                              f"{', '.join(map(repr, LOAD_FORMATS))}")
        # model.* keys: DeepInfer's load_format (lower-cased, as DeepInfer does) and tokenizer (None, or the model
        # itself: the checkpoint's tokenizer.json)
        model_keys = [f"model.load_format={load_format.lower()}"] if load_format.lower() != "auto" else []
        if tokenizer is not None and str(tokenizer) != str(model):
            path = Path(tokenizer).expanduser()  # absolute, so the engine-core process finds it whatever its cwd
            model_keys.append(f"model.tokenizer={_value(str(path.resolve() if path.exists() else tokenizer))}")
        engine = dict(ours.pop("engine", None) or {})
        engine.update(max_num_seqs=max_num_seqs, chunked_prefill=chunked_prefill)
        if max_num_batched_tokens is not None:
            engine["max_num_batched_tokens"] = max_num_batched_tokens
        if max_model_len is not None:
            engine["max_model_len"] = max_model_len
        cache = dict(ours.pop("cache", None) or {})
        cache.setdefault("memory_fraction", gpu_memory_utilization)
        self.decode_sequence = decode_sequence
        extra = [*model_keys, *layout, *ours.pop("overrides", ())]
        pick_decoding = not _decoding_chosen(extra, ours)
        overrides = overrides_for(model, extra, seed=seed, engine=engine, cache=cache, **ours)
        if pick_decoding and _has_draft_layers(overrides):
            # DeepInfer's default: DSpark with the checkpoint's draft layers (its variables: conf/decoding/dspark)
            overrides.append("decoding=dspark")
        settings = load_settings(overrides)
        config = _model_config(settings.model.path, weights=settings.model.load_format == "auto")
        if not chunked_prefill and max_num_batched_tokens is None:
            # DeepInfer's default step budget without chunking: the longest sequence, so every prompt fits one step
            limit = settings.engine.max_model_len or config.max_position_embeddings
            budget = max(limit, settings.engine.max_num_batched_tokens)
            settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine,
                                                                                max_num_batched_tokens=budget))
        self._llm = _LLM.from_settings(settings)

    @property
    def llm_engine(self):
        return self._llm._engine

    def get_tokenizer(self):
        """A transformers PreTrainedTokenizerFast over the served tokenizer (DeepInfer's return type)."""
        if getattr(self, "_hf_tokenizer", None) is None:
            from deepinfer.entrypoints.hf_tokenizer import hf_tokenizer

            self._hf_tokenizer = hf_tokenizer(self._llm.program.tokenize.tokenizer, self._llm._engine.info.eos_token_id)
        return self._hf_tokenizer

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm: bool = True,
                 multi_modal_data=None) -> list[str] | list[list[TokenOutput]]:
        """DeepInfer's generate: strings (the decoded output tokens, special tokens included, as DeepInfer's
        tokenizer.decode gives them) with decode_sequence=True, else per request its per-token outputs
        (entrypoints/token_outputs.py). sampling_params None: DeepInfer's SamplingParams() (not the config's
        sampling section). A request that fails (a schema that does not compile, ...) fails alone, as DeepInfer's
        FINISHED_SO_FAILED: its string is "" (its list empty or cut short) and one line is logged.

        multi_modal_data (a model with a vision tower): DeepInfer's {"image_bytes": [...], "image_sizes":
        [[w, h], ...]}, one dict for one prompt or one per prompt; one image placeholder per image in each prompt.
        Stricter than DeepInfer: declared sizes that differ from the decoded image, or a placeholder count that
        differs from the image count, end the request with a one-line error instead of a warning."""
        if multi_modal_data is not None and getattr(self._llm.program.model, "vision", None) is None:
            model_dir = getattr(self._llm.program.model, "model_dir", self._llm.settings.model.path)
            raise ConfigError(_images_refused(model_dir))
        if prompts is None and prompt_token_ids is None:
            raise ValueError("Either prompts or prompt_token_ids must be provided.")
        if sampling_params is None:
            from deepinfer.sampling_params import SamplingParams

            sampling_params = SamplingParams()
        if prompt_token_ids is not None:
            ids = [[int(t) for t in p] for p in prompt_token_ids]  # numpy arrays as DeepInfer takes them
            if prompts is not None:
                prompts = [prompts] if isinstance(prompts, str) else prompts
                if len(prompts) != len(ids):
                    raise ValueError("The lengths of prompts and prompt_token_ids must be the same.")
            outputs = self._llm.generate(prompt_token_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm,
                                         multi_modal_data=multi_modal_data)
        else:
            outputs = self._llm.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                                         multi_modal_data=multi_modal_data)
        for i, o in enumerate(outputs):
            if o.finish_reason == "error":
                log.error("request %d failed: %s", i, o.error)
        if not self.decode_sequence:
            return [per_token(i, o) for i, o in enumerate(outputs)]
        decode = self._llm.program.tokenize.tokenizer.decode
        return ["" if o.finish_reason == "error" else decode(o.token_ids, skip_special_tokens=False)
                for o in outputs]

    def close(self) -> None:
        self._llm.close()

    def __exit__(self, *exc) -> None:
        self.close()
