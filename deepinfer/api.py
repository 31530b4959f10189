"""The Python API: `LLM(model=..., **overrides).generate(...)`.

LLM composes its configuration with Hydra's compose API from the same conf/ tree and the same resolve step as
`python -m deepinfer`, so a keyword argument here and a CLI override there mean exactly the same thing:

    LLM(model="path/or/hub-id", hardware="cpu", dtype="float32", engine={"max_num_seqs": 8})
    == python -m deepinfer model.path=path/or/hub-id hardware=cpu model.dtype=float32 engine.max_num_seqs=8
"""

from __future__ import annotations

import dataclasses

from typing import Any, Callable, Iterable, Iterator, Sequence

from deepinfer.config.compose import compose, group_options
from deepinfer.config.errors import ConfigError, explain
from deepinfer.config.resolve import resolve
from deepinfer.config.schema import Settings
from deepinfer.outputs import RequestOutput, error_output
from deepinfer.sampling import SamplingParams
from deepinfer.streaming import StreamUpdate

GROUPS = ("hardware", "parallel", "decoding", "yoco", "pipeline")
SECTIONS = ("engine", "cache", "runtime", "sampling", "hardware", "model")
# Flat keyword shortcuts (vLLM-style names) -> config keys.
ALIASES = {
    "dtype": "model.dtype",
    "load_format": "model.load_format",
    "tokenizer": "model.tokenizer",
    "seed": "runtime.seed",
    "batch_invariant": "runtime.batch_invariant",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "max_model_len": "engine.max_model_len",
    "zero_overhead_scheduling": "engine.zero_overhead_scheduling",
    "process": "engine.process",
    "memory_budget": "cache.memory_budget",
    "memory_fraction": "cache.memory_fraction",
    "block_size": "cache.block_size",
}


def overrides_for(model: str | None = None, overrides: Iterable[str] = (), **kwargs) -> list[str]:
    """Hydra override strings for LLM's arguments. `model`: an option of conf/model (tiny, v41_flash) or a
    path / hub id (-> model.path). Group names take an option (hardware="cpu"); section names take a dict
    (engine={"max_num_seqs": 8}); ALIASES take a value; `recipe` selects +recipe=NAME."""
    out: list[str] = []
    if "recipe" in kwargs:
        out.append(f"+recipe={kwargs.pop('recipe')}")
    if model is not None:
        model = str(model)
        out.append(f"model={model}" if model in group_options("model") else f"model.path={_value(model)}")
    for key, value in kwargs.items():
        if key in GROUPS and isinstance(value, str):
            out.append(f"{key}={value}")
        elif key in SECTIONS and isinstance(value, dict):
            out.extend(f"{key}.{k}={_value(v)}" for k, v in _flatten(value))
        elif key in ALIASES:
            out.append(f"{ALIASES[key]}={_value(value)}")
        else:
            allowed = sorted({"model", "recipe", "overrides", *GROUPS, *SECTIONS, *ALIASES})
            raise ConfigError(f"LLM({key}={value!r}): unknown argument {key!r}; allowed: {', '.join(allowed)}")
    out.extend(overrides)
    return out


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _value(v: Any) -> str:
    """A Python value in Hydra's override grammar (strings always quoted, so paths and ids pass verbatim)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    s = str(v)
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def load_settings(overrides: Sequence[str], found=None) -> Settings:
    """compose + resolve, with every composition error turned into one-line ConfigError. found: the detected
    hardware (deepinfer.config.hardware.Found; detected when None)."""
    try:
        cfg = compose(overrides)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra/OmegaConf composition errors: user input, reworded
        raise explain(exc, overrides) from None
    return resolve(cfg, found=found)


class LLM:
    """A loaded model and its step program. Use as a context manager or call close() when done."""

    def __init__(self, model: str | None = None, *, overrides: Iterable[str] = (), **kwargs):
        settings = load_settings(overrides_for(model, overrides, **kwargs))
        self._init(settings)

    @classmethod
    def from_settings(cls, settings: Settings) -> "LLM":
        """An LLM for settings already resolved (the CLI composes with Hydra's app, then calls this)."""
        llm = cls.__new__(cls)
        llm._init(settings)
        return llm

    def _init(self, settings: Settings) -> None:
        from deepinfer.engine import LLMEngine
        from deepinfer.pipeline import load_program

        # the frontend needs the tokenizer and the model's limits; a subprocess engine core holds the weights
        self.program, self.settings = load_program(settings, weights=settings.engine.process == "inproc")
        self._engine = LLMEngine.for_settings(self.settings, self.program)
        self._next_id = 0
        self.last_metrics: dict | None = None

    @property
    def tokenizer(self):
        return self.program.tokenize

    def default_sampling_params(self) -> SamplingParams:
        return self.settings.sampling.params()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]] | Sequence[dict] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        prompt_token_ids: Sequence[list[int]] | None = None,
        on_update: Callable[[int, list[int]], None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. prompts: text, a list of texts, lists of token ids or
        {"prompt": ...} / {"prompt_token_ids": [...]} dicts; or prompt_token_ids=[[...], ...]. sampling_params:
        one for all, or one per prompt (default: the config's `sampling` section). on_update(index, new_token_ids)
        is called from this thread as tokens arrive (index: the prompt's; with n > 1, sample 0's tokens only);
        raising from it aborts the unfinished requests and propagates. See `generate_iter` for an iterator."""
        if self._engine is None:
            raise RuntimeError("LLM.generate after close()")
        items = _normalize_prompts(prompts, prompt_token_ids)
        params = _per_prompt(sampling_params, len(items), self.default_sampling_params)
        outputs: list[RequestOutput | None] = [None] * len(items)
        ids, sps, texts, rids, owners = [], [], [], [], []
        for i, ((text, tok), sp) in enumerate(zip(items, params)):
            rid, self._next_id = self._next_id, self._next_id + 1
            if tok is not None and not isinstance(tok, list):
                outputs[i] = error_output(rid, text, [], f"prompt_token_ids={tok!r} is not a list of token ids")
                continue
            if tok is None:
                if not isinstance(text, str):
                    outputs[i] = error_output(rid, None, [], f"prompt {text!r} is not a string")
                    continue
                tok = self.program.tokenize.encode(text)
            # n independent samples: n requests of n=1 whose seeds derive from the parent's
            for child, child_sp in enumerate(_expand_samples(sp, rid, self.settings.runtime.seed)):
                ids.append(list(tok))
                sps.append(child_sp)
                texts.append(text)
                rids.append(rid if child == 0 else self._next_id)
                self._next_id += child > 0
                owners.append(i)
        samples: dict[int, list[RequestOutput]] = {}
        forward = None
        if on_update is not None:
            first = {owners.index(i) for i in set(owners)}  # each prompt's sample 0

            def forward(k: int, new_ids: list[int]) -> None:
                if k in first:
                    on_update(owners[k], new_ids)

        if ids:
            done = self._engine.generate(ids, sps, use_tqdm=use_tqdm, prompts=texts, request_ids=rids,
                                         on_update=forward)
            for i, out in zip(owners, done):
                samples.setdefault(i, []).append(out)
        for i, outs in samples.items():
            outputs[i] = outs[0] if len(outs) == 1 else dataclasses.replace(outs[0], samples=outs)
        self.last_metrics = self._engine.last_metrics
        return outputs

    def generate_iter(self, prompts=None, sampling_params=None, *, prompt_token_ids=None) -> Iterator[StreamUpdate]:
        """generate() as an iterator: StreamUpdate(index, token_ids) as tokens arrive, then one StreamUpdate per
        prompt with `output` set (its RequestOutput), in input order. The engine runs in a helper thread; leaving
        the loop early (break, an exception) aborts the unfinished requests before this returns."""
        from deepinfer.streaming import stream_generate

        return stream_generate(self.generate, prompts, sampling_params, prompt_token_ids)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        self.program = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _normalize_prompts(prompts, prompt_token_ids) -> list[tuple[str | None, list[int] | None]]:
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("generate: pass prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        return [(None, list(ids)) for ids in prompt_token_ids]
    if prompts is None:
        raise ValueError("generate: prompts or prompt_token_ids is required")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    items = []
    for p in prompts:
        if isinstance(p, dict):
            ids = p.get("prompt_token_ids")
            # ids that are not a list stay as they are: the engine answers that request alone with an error
            items.append((p.get("prompt"), list(ids) if isinstance(ids, (list, tuple)) else ids))
        elif isinstance(p, (list, tuple)):
            items.append((None, list(p)))
        else:
            items.append((p, None))
    return items


def _per_prompt(sampling_params, n: int, default) -> list[SamplingParams]:
    if sampling_params is None:
        return [default() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    sampling_params = list(sampling_params)
    if len(sampling_params) != n:
        raise ValueError(f"generate: {len(sampling_params)} sampling_params for {n} prompts; allowed: 1 or {n}")
    return sampling_params


def _expand_samples(sp: SamplingParams, request_id: int, base_seed: int | None) -> list[SamplingParams]:
    """n > 1: n requests with n=1; sample i draws with child_seed(seed, i) (sample 0 keeps the seed)."""
    if sp.n == 1:
        return [sp]
    from deepinfer.sampling import child_seed, request_seed

    seed = sp.seq_seed
    if seed is None:
        seed = child_seed(base_seed, request_id) if base_seed is not None else request_seed(None)
    return [dataclasses.replace(sp, n=1, seq_seed=child_seed(seed, i)) for i in range(sp.n)]
