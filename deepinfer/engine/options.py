"""The engine knobs, resolved into one frozen, picklable object that travels to the engine-core process.

Every field comes from the typed settings (deepinfer/config/schema.py is the one place for defaults and ranges,
checked by the resolve step): EngineOptions has no defaults and no checks of its own, and `for_settings` is its one
constructor. Tests and benchmarks that need options without a config build them from the schema's defaults:
`EngineOptions.for_settings(Settings(), process="inproc", memory_budget=...)`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any


def _setting(path: str, convert=None):
    """A field whose value is the setting at `path` (section.key), passed through `convert` if given."""
    return field(metadata={"setting": path, "convert": convert})


def grammar_keywords(sampling) -> tuple:
    """The settings' sampling.xgrammar_* knobs as (GrammarCompilerPool keyword, value) pairs: the prefix dropped,
    the timeout in seconds."""
    pairs = [(f.name[len("xgrammar_"):], getattr(sampling, f.name)) for f in fields(sampling)
             if f.name.startswith("xgrammar_")]
    return tuple(("timeout_s" if name == "timeout" else name, value) for name, value in pairs)


@dataclass(frozen=True)
class EngineOptions:
    # engine.*
    max_num_seqs: int = _setting("engine.max_num_seqs")
    max_num_batched_tokens: int = _setting("engine.max_num_batched_tokens")
    max_model_len: int | None = _setting("engine.max_model_len")  # None: the model's max_position_embeddings
    zero_overhead_scheduling: bool = _setting("engine.zero_overhead_scheduling")
    process: str = _setting("engine.process")  # "subprocess" | "inproc"
    startup_timeout_s: float = _setting("engine.startup_timeout")  # model loading in the engine process
    # how often a waiting frontend checks the engine process is alive
    liveness_poll_s: float = _setting("engine.liveness_poll")
    # the core is declared dead (EngineDeadError) when its heartbeat is older than this (killed, SIGSTOPped,
    # frozen with the GIL held)
    heartbeat_timeout_s: float = _setting("engine.heartbeat_timeout")
    # a step loop that has not turned for this long while heartbeats still come (a deadlock in a step) is reported
    # as hung. Longer than the heartbeat's: a first step on a GPU may JIT-compile kernels.
    step_timeout_s: float = _setting("engine.step_timeout")
    heartbeat_interval_s: float = _setting("engine.heartbeat_interval")
    # a message the core's socket does not take within this: the core is gone
    send_timeout_s: float = _setting("engine.send_timeout")
    # how long the core gets after the shutdown message, then SIGTERM
    close_grace_s: float = _setting("engine.close_grace")
    # cache.*: bytes for the caches (an explicit cache.memory_budget), else the bytes the engine may use on its
    # device, weights included (cache.memory_limit, resolved from memory_fraction): the caches get what the model
    # left of them (engine/core.py)
    memory_budget: int | None = _setting("cache.memory_budget")
    memory_limit: int | None = _setting("cache.memory_limit")
    block_size: int = _setting("cache.block_size")
    # cache.prefix_*: reuse a shared prefix's cache (the resolve step turned null into a bool; unresolved settings,
    # the schema's defaults, leave it off), the budget share of window checkpoints, blocks between checkpoints
    prefix_caching: bool = _setting("cache.prefix_caching", bool)
    prefix_checkpoint_fraction: float = _setting("cache.prefix_checkpoint_fraction")
    prefix_checkpoint_interval: int = _setting("cache.prefix_checkpoint_interval")
    # runtime.*
    # requests without seq_seed: child_seed(seed, request id); None: a random seed each
    seed: int | None = _setting("runtime.seed")
    # torch intra-op threads in the engine process (None: torch's default)
    num_threads: int | None = _setting("runtime.num_threads")
    enforce_eager: bool = _setting("runtime.enforce_eager")  # no CUDA graphs (DEEPINFER_ENFORCE_EAGER)
    # graph batch buckets: 1, 2, 4, <interval, then every interval
    cudagraph_batch_size_interval: int = _setting("runtime.cudagraph_batch_size_interval")
    # sampling.xgrammar_* as GrammarCompilerPool's keywords ((name, value) pairs; schema.py says what each bounds)
    grammar_limits: tuple[tuple[str, Any], ...] = _setting("sampling", grammar_keywords)
    # decoding.*: drafts verified per request and step (0: off; with decoding=dspark only, see for_settings), the
    # cache's rollback depth (any decoding, DEEPINFER_MAX_BACKTRACKING_TOKENS; the larger of this and
    # num_draft_tokens + 1), confidence-scheduled verification (dspark only), where its cost curve is cached and
    # for how long, and the confidence head's temperature(s)
    num_draft_tokens: int = _setting("decoding.num_draft_tokens")
    max_backtracking_tokens: int = _setting("decoding.max_backtracking_tokens")
    spec_varlen: bool = _setting("decoding.varlen")
    decode_perf_cache_dir: str | None = _setting("decoding.perf_cache_dir")
    decode_perf_cache_ttl_s: float = _setting("decoding.perf_cache_ttl")
    confidence_temperature: tuple = _setting("decoding.confidence_temperature", tuple)

    @property
    def max_rollback(self) -> int:
        from deepinfer.config.schema import rollback_rows

        return rollback_rows(self.num_draft_tokens, self.max_backtracking_tokens)

    @classmethod
    def for_settings(cls, settings, **overrides) -> "EngineOptions":
        """The options of Settings (resolved ones: LLM, the server, the ranks; the schema's defaults,
        `Settings()`, in tests), then `overrides` by field name."""
        values = {}
        for f in fields(cls):
            value = operator.attrgetter(f.metadata["setting"])(settings)
            values[f.name] = value if f.metadata["convert"] is None else f.metadata["convert"](value)
        if settings.decoding.name != "dspark":  # drafting is DSpark's alone
            values.update(num_draft_tokens=0, spec_varlen=False)
        unknown = set(overrides) - values.keys()
        if unknown:
            raise TypeError(f"EngineOptions has no field(s) {', '.join(sorted(unknown))}")
        values.update(overrides)
        return cls(**values)
