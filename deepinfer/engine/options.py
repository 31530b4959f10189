"""The engine knobs, resolved into one frozen, picklable object that travels to the engine-core process.

Built from the config room's EngineSettings / CacheSettings / RuntimeSettings (read duck-typed, so any object with
those fields works) or directly in tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    zero_overhead_scheduling: bool = True
    process: str = "subprocess"  # "subprocess" | "inproc"
    memory_budget: int | None = None  # bytes for per-request model state; None: memory_fraction of free memory
    memory_fraction: float = 0.5
    block_size: int = 64
    seed: int | None = None  # requests without seq_seed: child_seed(seed, request id); None: a random seed each (runtime.seed's default)
    num_threads: int | None = None  # torch intra-op threads in the engine process (None: torch's default)
    startup_timeout_s: float = 300.0  # model loading in the engine process
    liveness_poll_s: float = 0.2  # how often a waiting frontend checks that the engine process is alive
    # engine.heartbeat_timeout: the core is declared dead (EngineDeadError) when its heartbeat is older than this
    # (killed, SIGSTOPped, frozen with the GIL held).
    heartbeat_timeout_s: float = 30.0
    # engine.step_timeout: a step loop that has not turned for this long while heartbeats still come (a deadlock in
    # a step) is reported as hung. Longer than the heartbeat's: a first step on a GPU may JIT-compile kernels.
    step_timeout_s: float = 300.0
    heartbeat_interval_s: float = 0.5
    send_timeout_s: float = 5.0  # a message the core's socket does not take within this long: the core is gone
    close_grace_s: float = 2.0  # close(): how long the core gets after the shutdown message, then after SIGTERM
    # Structured outputs (sampling.xgrammar_*): a grammar that does not compile within this many seconds ends its
    # request with an error; compiled grammars are cached up to this many bytes (xgrammar: -1 means unbounded).
    xgrammar_timeout: float = 20.0
    xgrammar_cache_limit_bytes: int = 1 << 30
    enforce_eager: bool = False  # no CUDA graphs (runtime.enforce_eager, DEEPINFER_ENFORCE_EAGER)
    cudagraph_batch_size_interval: int = 8  # graph batch buckets: 1, 2, 4, <interval, then every interval
    xgrammar_max_schema_bytes: int = 1 << 20  # larger schemas end their request at once (sampling/grammar.py)
    # DSpark speculative decoding (decoding=dspark): drafts verified per request and step (0: off), the cache's
    # rollback depth (the larger of this and num_draft_tokens + 1), confidence-scheduled verification
    # (DEEPINFER_ENABLE_MTP_VARLEN), where its cost curve is cached, and the confidence head's temperature(s).
    num_draft_tokens: int = 0
    max_backtracking_tokens: int = 0
    spec_varlen: bool = False
    decode_perf_cache_dir: str | None = None
    decode_perf_cache_ttl_s: float = 3600.0
    confidence_temperature: tuple = (1.0,)

    @property
    def max_rollback(self) -> int:
        from deepinfer.config.schema import rollback_rows

        return rollback_rows(self.num_draft_tokens, self.max_backtracking_tokens)

    @classmethod
    def for_settings(cls, settings, **overrides) -> "EngineOptions":
        """The options of resolved Settings: every section an engine reads (LLM and the server alike)."""
        return cls.from_settings(settings.engine, settings.cache, settings.runtime, settings.sampling,
                                 settings.decoding, **overrides)

    @classmethod
    def from_settings(cls, engine=None, cache=None, runtime=None, sampling=None, decoding=None,
                      **overrides) -> "EngineOptions":
        values = {}
        if decoding is not None:  # the rollback rows with any decoding (DEEPINFER_MAX_BACKTRACKING_TOKENS)
            values["max_backtracking_tokens"] = decoding.max_backtracking_tokens
        if decoding is not None and getattr(decoding, "name", "plain") == "dspark":
            values.update(
                num_draft_tokens=decoding.num_draft_tokens,
                spec_varlen=decoding.varlen,
                decode_perf_cache_dir=decoding.perf_cache_dir,
                confidence_temperature=tuple(decoding.confidence_temperature),
            )
        for section, names in (
            (engine, ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "zero_overhead_scheduling", "process")),
            (cache, ("memory_budget", "memory_fraction", "block_size")),
            (runtime, ("seed", "num_threads", "enforce_eager", "cudagraph_batch_size_interval")),
            (sampling, ("xgrammar_timeout", "xgrammar_cache_limit_bytes")),
        ):
            if section is not None:
                values.update({n: getattr(section, n) for n in names if hasattr(section, n)})
        for key in ("heartbeat_timeout", "step_timeout"):
            if engine is not None and hasattr(engine, key):
                values[f"{key}_s"] = getattr(engine, key)
        values.update(overrides)
        return cls(**values)

    def __post_init__(self):
        if self.process not in ("subprocess", "inproc"):
            raise ValueError(f"engine.process must be 'subprocess' or 'inproc', got {self.process!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine option {name} must be >= 1, got {getattr(self, name)}")
        if not self.xgrammar_timeout > 0:
            raise ValueError(f"sampling.xgrammar_timeout must be > 0 seconds, got {self.xgrammar_timeout}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"cache.memory_fraction must be in (0, 1], got {self.memory_fraction}")
