"""The engine knobs, resolved into one frozen, picklable object that travels to the engine-core process.

Every field comes from the typed settings (deepinfer/config/schema.py is the one place for defaults and ranges,
checked by the resolve step): EngineOptions has no defaults and no checks of its own, and `for_settings` is its one
constructor. Tests and benchmarks that need options without a config build them from the schema's defaults:
`EngineOptions.for_settings(Settings(), process="inproc", memory_budget=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EngineOptions:
    # engine.*
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None  # None: the model's max_position_embeddings
    zero_overhead_scheduling: bool
    process: str  # "subprocess" | "inproc"
    startup_timeout_s: float  # engine.startup_timeout: model loading in the engine process
    liveness_poll_s: float  # engine.liveness_poll: how often a waiting frontend checks the engine process is alive
    # engine.heartbeat_timeout: the core is declared dead (EngineDeadError) when its heartbeat is older than this
    # (killed, SIGSTOPped, frozen with the GIL held).
    heartbeat_timeout_s: float
    # engine.step_timeout: a step loop that has not turned for this long while heartbeats still come (a deadlock in
    # a step) is reported as hung. Longer than the heartbeat's: a first step on a GPU may JIT-compile kernels.
    step_timeout_s: float
    heartbeat_interval_s: float  # engine.heartbeat_interval
    send_timeout_s: float  # engine.send_timeout: a message the core's socket does not take: the core is gone
    close_grace_s: float  # engine.close_grace: how long the core gets after the shutdown message, then SIGTERM
    # cache.*: bytes for the caches (an explicit cache.memory_budget), else the bytes the engine may use on its
    # device, weights included (cache.memory_limit, resolved from memory_fraction): the caches get what the model
    # left of them (engine/core.py)
    memory_budget: int | None
    memory_limit: int | None
    block_size: int
    # cache.prefix_*: reuse a shared prefix's cache (the resolve step turned null into a bool; unresolved settings,
    # the schema's defaults, leave it off), the budget share of window checkpoints, blocks between checkpoints
    prefix_caching: bool
    prefix_checkpoint_fraction: float
    prefix_checkpoint_interval: int
    # runtime.*
    seed: int | None  # requests without seq_seed: child_seed(seed, request id); None: a random seed each
    num_threads: int | None  # torch intra-op threads in the engine process (None: torch's default)
    enforce_eager: bool  # no CUDA graphs (DEEPINFER_ENFORCE_EAGER)
    cudagraph_batch_size_interval: int  # graph batch buckets: 1, 2, 4, <interval, then every interval
    # sampling.xgrammar_*: a grammar that does not compile within the timeout ends its request with an error;
    # compiled grammars are cached up to the limit (xgrammar: -1 means unbounded); larger schemas end their request;
    # heavy compilations share heavy_lanes, a server client at most max_per_client of them per lane
    xgrammar_timeout: float
    xgrammar_cache_limit_bytes: int
    xgrammar_max_schema_bytes: int
    xgrammar_max_schema_values: int
    xgrammar_heavy_lanes: int
    xgrammar_max_per_client: int
    # decoding.* (DSpark, decoding=dspark): drafts verified per request and step (0: off), the cache's rollback
    # depth (the larger of this and num_draft_tokens + 1), confidence-scheduled verification, where its cost curve
    # is cached and for how long, and the confidence head's temperature(s)
    num_draft_tokens: int
    max_backtracking_tokens: int
    spec_varlen: bool
    decode_perf_cache_dir: str | None
    decode_perf_cache_ttl_s: float
    confidence_temperature: tuple

    @property
    def max_rollback(self) -> int:
        from deepinfer.config.schema import rollback_rows

        return rollback_rows(self.num_draft_tokens, self.max_backtracking_tokens)

    @classmethod
    def for_settings(cls, settings, **overrides) -> "EngineOptions":
        """The options of Settings (resolved ones: LLM, the server, the ranks; the schema's defaults,
        `Settings()`, in tests), then `overrides` by field name."""
        e, c, r, s, d = settings.engine, settings.cache, settings.runtime, settings.sampling, settings.decoding
        dspark = d.name == "dspark"
        values = dict(
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            max_model_len=e.max_model_len,
            zero_overhead_scheduling=e.zero_overhead_scheduling,
            process=e.process,
            startup_timeout_s=e.startup_timeout,
            liveness_poll_s=e.liveness_poll,
            heartbeat_timeout_s=e.heartbeat_timeout,
            step_timeout_s=e.step_timeout,
            heartbeat_interval_s=e.heartbeat_interval,
            send_timeout_s=e.send_timeout,
            close_grace_s=e.close_grace,
            memory_budget=c.memory_budget,
            memory_limit=c.memory_limit,
            block_size=c.block_size,
            prefix_caching=bool(c.prefix_caching),
            prefix_checkpoint_fraction=c.prefix_checkpoint_fraction,
            prefix_checkpoint_interval=c.prefix_checkpoint_interval,
            seed=r.seed,
            num_threads=r.num_threads,
            enforce_eager=r.enforce_eager,
            cudagraph_batch_size_interval=r.cudagraph_batch_size_interval,
            xgrammar_timeout=s.xgrammar_timeout,
            xgrammar_cache_limit_bytes=s.xgrammar_cache_limit_bytes,
            xgrammar_max_schema_bytes=s.xgrammar_max_schema_bytes,
            xgrammar_max_schema_values=s.xgrammar_max_schema_values,
            xgrammar_heavy_lanes=s.xgrammar_heavy_lanes,
            xgrammar_max_per_client=s.xgrammar_max_per_client,
            # the rollback rows with any decoding (DEEPINFER_MAX_BACKTRACKING_TOKENS); drafting with dspark only
            max_backtracking_tokens=d.max_backtracking_tokens,
            num_draft_tokens=d.num_draft_tokens if dspark else 0,
            spec_varlen=dspark and d.varlen,
            decode_perf_cache_dir=d.perf_cache_dir,
            decode_perf_cache_ttl_s=d.perf_cache_ttl,
            confidence_temperature=tuple(d.confidence_temperature),
        )
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"EngineOptions has no field(s) {', '.join(sorted(unknown))}")
        values.update(overrides)
        return cls(**values)
