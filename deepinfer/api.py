"""The Python API: `LLM(model=..., **overrides).generate(...)`.

LLM composes its configuration with Hydra's compose API from the same conf/ tree and the same resolve step as
`python -m deepinfer`, so a keyword argument here and a CLI override there mean exactly the same thing:

    LLM(model="path/or/hub-id", hardware="cpu", dtype="float32", engine={"max_num_seqs": 8})
    == python -m deepinfer model.path=path/or/hub-id hardware=cpu model.dtype=float32 engine.max_num_seqs=8
"""

from __future__ import annotations

import operator
import threading
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, Iterator, Sequence

from deepinfer.config.compose import compose, group_options
from deepinfer.config.errors import ConfigError, explain
from deepinfer.config.resolve import resolve
from deepinfer.config.schema import Settings
from deepinfer.outputs import RequestOutput, StreamUpdate
from deepinfer.sampling import SamplingParams

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
    "enable_prefix_caching": "cache.prefix_caching",  # vLLM's name; None: on where a hit is exact (all layouts)
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
        elif key == "enable_prefix_caching" and value is not None and type(value) is not bool:
            raise ConfigError(f"LLM(enable_prefix_caching={value!r}) is not allowed; allowed: True, False or None")
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


_OUTPUT = operator.attrgetter("output")


class LLM(AbstractContextManager):
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
        from deepinfer.frontend import LLMEngine
        from deepinfer.pipeline import load_program

        # the frontend needs the tokenizer and the model's limits (no weights); the engine core builds the model
        self._configured = settings  # model.path as given: what LLM.chat's model naming reads, as the server's
        self._chat = None  # the deepseek_recipe converter, built on the first chat()
        self.program, self.settings = load_program(settings, weights=False)
        self._engine = LLMEngine.for_settings(self.settings, self.program.tokenize.tokenizer,
                                              getattr(self.program.model, "vision", None))
        # one caller at a time: the engine client's sockets and the frontend's loop are not thread-safe, so calls
        # from several threads are served one after the other (reentrant: one thread may interleave iterators)
        self._lock = threading.RLock()

    @property
    def tokenizer(self):
        return self.program.tokenize

    @property
    def last_metrics(self) -> dict | None:
        return None if self._engine is None else self._engine.last_metrics

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
        multi_modal_data: dict | Sequence[dict | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. prompts: text, a list of texts, lists of token ids or
        {"prompt": ...} / {"prompt_token_ids": [...]} dicts (a dict may carry vLLM's "cache_salt": a string; only
        prompts with the same salt, or none, share cached prefixes, docs/prefix-cache.md); or
        prompt_token_ids=[[...], ...]. sampling_params: one for all, or one per prompt (default: the config's
        `sampling` section). on_update(index, new_token_ids) is called from this thread as tokens arrive (index:
        the prompt's; with n > 1, sample 0's tokens only); raising from it aborts the unfinished requests and
        propagates. See `generate_iter` for an iterator.

        multi_modal_data (a model with a vision tower, docs/vision.md): DeepInfer's form, a dict for one prompt or
        a list with one dict (or None) per prompt: {"image_bytes": [png, ...], "image_sizes": [[w, h], ...]}
        (sizes optional, checked against the decoded images). The prompt holds one image placeholder
        (`image_token_id`) per image, in order; each becomes the image's span, and RequestOutput.prompt_token_ids
        shows the expanded ids (vocab_size + 2, then vocab_size + 1 for the rest of each span)."""
        # the frontend's loop (LLMEngine.stream), drained here: its final updates carry the outputs
        with self._lock:
            return list(map(_OUTPUT, self._live().stream(prompts, sampling_params, prompt_token_ids=prompt_token_ids,
                                                         use_tqdm=use_tqdm, tokens=False, on_update=on_update,
                                                         default_params=self.default_sampling_params,
                                                         multi_modal_data=multi_modal_data)))

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: Sequence[dict] | None = None,
        thinking: bool | None = None,
    ) -> list[RequestOutput]:
        """vLLM's offline chat: one conversation (a list of {"role", "content"} messages, OpenAI's Chat Completions
        form) or a list of them, rendered into DeepSeek-V4.1 prompts by deepseek_recipe exactly as the server's
        /v1/chat/completions renders them, then generated as generate() does (one RequestOutput per conversation;
        its text is the raw completion: reasoning, `</think>` and DSML tool-call markup are not parsed here).
        tools: OpenAI function tools, put into the system prompt. thinking: None is serve.default_thinking's rule
        (off for an embedded model, on for a DeepSeek checkpoint). A conversation the recipe refuses raises
        ValueError with its one-line reason."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        ids = [self._chat_prompt(conv, tools, thinking, i) for i, conv in enumerate(conversations)]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm)

    def _chat_prompt(self, messages, tools, thinking, index: int) -> list[int]:
        from deepinfer.serving.errors import HTTPError
        from deepinfer.serving.server import converter_for

        if self._chat is None:
            self._chat = converter_for(self._configured, self.program.tokenize.tokenizer,
                                       self._live().info.max_model_len, getattr(self.program.model, "vision", None))
        body: dict = {"messages": list(messages) if isinstance(messages, (list, tuple)) else messages}
        if tools is not None:
            body["tools"] = list(tools)
        if thinking is not None:
            if not isinstance(thinking, bool):
                raise ValueError(f"chat(thinking={thinking!r}) is invalid; allowed: None, True or False")
            body["thinking"] = {"type": "enabled" if thinking else "disabled"}
        try:
            return self._chat.prompt_ids("chat", body)
        except HTTPError as exc:
            raise ValueError(f"chat: conversation {index}: {exc.message}") from None

    def generate_iter(self, prompts=None, sampling_params=None, *, prompt_token_ids=None,
                      multi_modal_data=None) -> Iterator[StreamUpdate]:
        """generate() as an iterator: StreamUpdate(index, token_ids) as tokens arrive, then one StreamUpdate per
        prompt with `output` set (its RequestOutput), in input order. It is the frontend's loop itself (no thread):
        leaving it early (close(), break, an exception) aborts the unfinished requests. From its first item until
        it ends or is closed it holds the LLM: other threads' calls wait for it."""
        return self._holding(self._live().stream(prompts, sampling_params, prompt_token_ids=prompt_token_ids,
                                                 default_params=self.default_sampling_params,
                                                 multi_modal_data=multi_modal_data))

    def _holding(self, updates: Iterator[StreamUpdate]) -> Iterator[StreamUpdate]:
        with self._lock:
            yield from updates

    def _live(self):
        if self._engine is None:
            raise RuntimeError("LLM.generate after close()")
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        self.program = None

    def __exit__(self, *exc) -> None:
        self.close()
