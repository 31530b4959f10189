"""The typed shape of DeepInfer's configuration: one frozen dataclass per config section.

These classes do two jobs. Registered with Hydra's ConfigStore (``deepinfer.config.compose``) they are the
structured-config schema, so an unknown key or a value of the wrong type fails while Hydra composes. After the
resolve step (``deepinfer.config.resolve``) instances of them are the only configuration the rest of the program
sees: plain frozen objects, cheap to read in hot paths, no DictConfig.

Ranges are declared next to each field (``allowed``) and checked by the resolve step, which knows the full dotted
key and can therefore say ``sampling.top_p=2.0 is out of range; allowed: (0, 1]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


# ---- field helpers -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Interval:
    """A numeric range; `lo_open`/`hi_open` make an end exclusive. `text` overrides the printed form."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    text: str | None = None
    also: tuple = ()  # isolated values allowed outside the interval (top_k = -1)

    def contains(self, v: float) -> bool:
        if not math.isfinite(v):  # nan passes every comparison; no setting takes an infinity
            return False
        if v in self.also:
            return True
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return not (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))

    def __str__(self) -> str:
        if self.text:
            return self.text
        lo = "-inf" if self.lo is None else f"{self.lo:g}"
        hi = "inf" if self.hi is None else f"{self.hi:g}"
        lb = "(" if self.lo_open or self.lo is None else "["
        rb = ")" if self.hi_open or self.hi is None else "]"
        return f"{lb}{lo}, {hi}{rb}"


def setting(default: Any = MISSING, *, allowed: Interval | tuple | None = None, factory=None):
    """A dataclass field with its allowed range (Interval) or choices (tuple) recorded for the resolve step."""
    meta = {"allowed": allowed} if allowed is not None else {}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


POSITIVE = Interval(0, None, lo_open=True)
NON_NEGATIVE = Interval(0, None)
AT_LEAST_1 = Interval(1, None, text="an integer >= 1")


def up_to(lo: int, hi: int) -> Interval:
    """An integer range with an upper bound: no knob may ask for a start-up footprint the machine cannot hold."""
    return Interval(lo, hi, text=f"an integer in [{lo}, {hi}]")


# Upper bounds (why these numbers): generous for the largest deployment in recipes/ (64 sequences, 8192
# tokens/step, 1M-token contexts), small enough that start-up bookkeeping stays in megabytes.
MAX_SEQS = 1 << 16
MAX_BATCHED_TOKENS = 1 << 20
MAX_MODEL_LEN = 1 << 24
MAX_BLOCK_SIZE = 1 << 13
MAX_TOKENS = 1 << 24
MAX_THREADS = 1024
MAX_SECONDS = Interval(0, 3600, lo_open=True)  # (0, 1 hour]
MAX_CACHE_BYTES = 1 << 40
UINT64 = Interval(0, 2**64 - 1, text="[0, 2**64 - 1]")

HARDWARE_NAMES = ("cpu", "sm90", "sm100", "ascend950", "auto")
DEVICES = ("cpu", "cuda", "npu", "auto")
DTYPES = ("float32", "bfloat16", "float16", "auto")
STAGES = ("tokenize", "prefill", "replay", "decode", "sample")
YOCO_MODES = ("off", "mask", "compact")
LOAD_FORMATS = ("auto", "dummy", "dummy_shared")
ENGRAM_STORAGE = ("device", "host")


# ---- sections ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HardwareSettings:
    """Where the model runs and which kernel backend each op kind prefers (first available wins)."""

    name: str = setting("cpu", allowed=HARDWARE_NAMES)
    device: str = setting("cpu", allowed=DEVICES)
    dtype: str = setting("float32", allowed=DTYPES)
    # CUDA compute capability major the preset was written for (9 = sm90, 10 = sm100); None: no requirement.
    cuda_major: Optional[int] = None
    # op kind (or `default`) -> ordered backend names; see kernels/registry.py for the kinds.
    backends: Dict[str, List[str]] = setting(factory=lambda: {"default": ["torch"]})
    # True: a preferred backend that is missing is an error; False: a logged fallback shown in the summary.
    strict_backends: bool = False


MAX_RANKS = 1024


@dataclass(frozen=True)
class EplbSettings:
    """EPLB, expert-parallel load balancing (DeepInfer's `model_executor/eplb`): redundant physical copies of the
    routed experts, placed from per-expert token counts measured over a window of steps, re-placed every
    `interval` steps. Needs expert_parallel_size > 1 (one rank holding every expert has nothing to balance)."""

    # DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS: at least this many redundant physical experts per MoE layer, rounded up
    # so that routed + redundant divide over the expert-parallel ranks (placement.resolve_num_extra_experts)
    redundant_experts: int = setting(0, allowed=up_to(0, 1 << 16))
    # DEEPINFER_EXPERT_COUNT_WINDOW_SIZE: steps of per-expert token counts the placement policy sees; with
    # re-placement on, in [1, interval] (DeepInfer's rule)
    window: int = setting(100, allowed=up_to(0, 1 << 20))
    interval: int = setting(0, allowed=up_to(0, 1 << 30))  # DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL; 0: off


@dataclass(frozen=True)
class ParallelSettings:
    """The parallel layout (conf/parallel/; run by deepinfer/distributed/ and the engine's data-parallel core):
    context_parallel_size x data_parallel_size ranks (one process and one device each), attention data-parallel,
    routed experts sharded over groups of expert_parallel_size ranks, which must divide the world (DeepInfer's
    rule). single: one process."""

    name: str = "single"  # a label (the option's file name); the sizes below are what the engine reads
    # DeepInfer's data_parallel_size: 0 means expert_parallel_size / context_parallel_size (at least 1), resolved
    # in the resolve step
    data_parallel_size: int = setting(1, allowed=up_to(0, MAX_RANKS))
    expert_parallel_size: int = setting(1, allowed=up_to(1, MAX_RANKS))
    context_parallel_size: int = setting(1, allowed=up_to(1, MAX_RANKS))
    # DEEPINFER_GLOO_TIMEOUT, seconds a collective (and the ranks' rendezvous) may wait before it raises. DeepInfer
    # waits 4 h; here 300 s (the engine's step_timeout), so a rank that stopped ends the run within minutes.
    timeout: float = setting(300.0, allowed=Interval(0, 86400, lo_open=True))
    eplb: EplbSettings = field(default_factory=EplbSettings)

    @property
    def world_size(self) -> int:
        """Processes of the layout: context x data parallel ranks (data_parallel_size resolved: not 0)."""
        return self.context_parallel_size * max(1, self.data_parallel_size)


@dataclass(frozen=True)
class DecodingSettings:
    """plain: one token per step. dspark: the checkpoint's DSpark draft layers propose up to num_draft_tokens
    tokens after every sampled one and the next step verifies them losslessly (conf/decoding/dspark.yaml)."""

    name: str = setting("plain", allowed=("plain", "dspark"))
    num_draft_tokens: int = setting(0, allowed=up_to(0, 16))  # DEEPINFER_USE_NEXTN_DECODE; 0: drafting off
    # DEEPINFER_MAX_BACKTRACKING_TOKENS: tokens every rolling cache keeps for rollback (at least drafts + 1)
    max_backtracking_tokens: int = setting(0, allowed=up_to(0, 1024))
    varlen: bool = False  # DEEPINFER_ENABLE_MTP_VARLEN: confidence-scheduled verification lengths
    perf_cache_dir: Optional[str] = None  # DEEPINFER_DECODE_PERF_CACHE_DIR: where its step-time curve is cached
    perf_cache_ttl: float = setting(3600.0, allowed=POSITIVE)  # seconds a cached step-time curve stays valid
    # DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE: one value, or one per draft position
    confidence_temperature: List[float] = setting(factory=lambda: [1.0])

    @property
    def max_rollback(self) -> int:
        return rollback_rows(self.num_draft_tokens if self.name == "dspark" else 0, self.max_backtracking_tokens)


def rollback_rows(num_draft_tokens: int, max_backtracking_tokens: int) -> int:
    """Tokens every rolling cache keeps beyond its window. DeepInfer's rule: max(DEEPINFER_MAX_BACKTRACKING_TOKENS,
    drafts + 1) with drafting on, the variable alone without."""
    if not num_draft_tokens:
        return max_backtracking_tokens
    return max(max_backtracking_tokens, num_draft_tokens + 1)


@dataclass(frozen=True)
class YocoSettings:
    """YOCO bounded replay (deepinfer/models/replay.py): in prefill steps the decoder layers see only the last
    `keep_tokens` rows of each sequence. The option (conf/yoco/) is DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE; a
    mode other than off needs the matching pipeline replay component (yoco_mask / yoco_compact)."""

    mode: str = setting("off", allowed=YOCO_MODES)
    # K, DEEPINFER_YOCO_PREFILL_KEEP_TOKENS (140: DeepInfer's README value for V4.1-Flash); must be at least the
    # model's sliding window + the max backtracking tokens (checked once the model's config is read)
    keep_tokens: int = setting(140, allowed=up_to(1, MAX_MODEL_LEN))


@dataclass(frozen=True)
class ModelSettings:
    name: str = MISSING
    # A local Hugging Face directory, a hub id, or `embedded:tiny` (built on first use, deepinfer/embedded.py).
    path: str = MISSING
    dtype: str = setting("auto", allowed=DTYPES)  # auto: the hardware's dtype
    # auto: the checkpoint's safetensors weights. dummy: random weights in the released storage formats for the
    # checkpoint's own config.json, drawn with runtime.seed (0 when null); no weight file is read, so a directory
    # (or hub id) with only config.json + tokenizer.json works (DeepInfer's load_format="dummy", for benchmarking).
    # dummy_shared (ours): the same, with the backbone layers of one kind sharing their tensors (the synthetic
    # full-depth models' memory: a 40-layer Flash-width model whose draw fits one GPU; every layer its own caches).
    load_format: str = setting("auto", allowed=LOAD_FORMATS)
    # null: the checkpoint's tokenizer.json. Otherwise a tokenizer.json file, or a directory holding one, used for
    # prompts, stop strings and the Engram hash tables; its vocabulary must fit the model's config.json.
    tokenizer: Optional[str] = None
    # where the Engram n-gram tables live: device, or host (RAM, pinned on CUDA and mapped into the GPU's address
    # space; each step's gather reads the rows it picks from there, deepinfer/models/engram_host.py): ~203 GB at
    # V4.1-Flash size, which no layout holds on its GPUs (DEEPINFER_ENGRAM_FORCE_GPU_STORAGE, conf/model/*.yaml)
    engram_storage: str = setting("device", allowed=ENGRAM_STORAGE)


@dataclass(frozen=True)
class StageSpec:
    component: Optional[str] = None  # registered component name; null = the stage is absent
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineSettings:
    name: str = "default"
    stages: Dict[str, StageSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSettings:
    """Knobs of the continuous-batching engine (deepinfer/engine)."""

    max_num_seqs: int = setting(64, allowed=up_to(1, MAX_SEQS))
    max_num_batched_tokens: int = setting(1024, allowed=up_to(1, MAX_BATCHED_TOKENS))
    # null: the model's max_position_embeddings; 2 is the least that holds a prompt token and a generated one
    max_model_len: Optional[int] = setting(None, allowed=up_to(2, MAX_MODEL_LEN))
    zero_overhead_scheduling: bool = True  # DEEPINFER_ZERO_OVERHEAD_SCHEDULING
    process: str = setting("subprocess", allowed=("subprocess", "inproc"))
    # seconds without a heartbeat (or without a turn of the step loop) after which the engine core is declared
    # dead and generate raises EngineDeadError
    heartbeat_timeout: float = setting(30.0, allowed=MAX_SECONDS)
    # seconds the step loop may go without turning while the core's heartbeat still comes (a deadlocked step);
    # long because a first step on a GPU may compile kernels
    step_timeout: float = setting(300.0, allowed=MAX_SECONDS)
    # DeepInfer's chunked_prefill: false = every prompt prefills in one step, so max_num_batched_tokens must
    # be at least max_model_len (checked once the model's limit is known: resolve.with_model_limits)
    chunked_prefill: bool = True
    # seconds the frontend waits for the engine process to load the model and report ready
    startup_timeout: float = setting(300.0, allowed=MAX_SECONDS)
    # seconds between a waiting frontend's checks that the engine process is alive
    liveness_poll: float = setting(0.2, allowed=MAX_SECONDS)
    heartbeat_interval: float = setting(0.5, allowed=MAX_SECONDS)  # seconds between the engine core's heartbeats
    # seconds a message may wait for the core's socket to take it; longer means the core is gone
    send_timeout: float = setting(5.0, allowed=MAX_SECONDS)
    # close(): seconds the core gets after the shutdown message, then again after SIGTERM, before SIGKILL
    close_grace: float = setting(2.0, allowed=MAX_SECONDS)


@dataclass(frozen=True)
class CacheSettings:
    # bytes for the caches; null: what the model leaves of memory_limit (the engine measures its weights after
    # loading them). At most the device's memory (checked in the resolve step). (The floor is low on purpose:
    # tests and small deployments size it to a few sequences; the engine says when a budget cannot hold one.)
    memory_budget: Optional[int] = setting(None, allowed=up_to(1 << 12, 1 << 50))
    # The fraction of the device's TOTAL memory the engine may use, weights, caches and activations included
    # (vLLM's gpu_memory_utilization; on the CPU, of the machine's RAM). Not read when memory_budget is set.
    memory_fraction: float = setting(0.5, allowed=Interval(0, 1, lo_open=True))
    # bytes the engine may use on its device, weights included; null: memory_fraction x the device's total memory,
    # resolved once in the resolve step (so every process of a run sees the same number). At most the device's memory.
    memory_limit: Optional[int] = setting(None, allowed=up_to(1 << 12, 1 << 50))
    block_size: int = setting(64, allowed=up_to(8, MAX_BLOCK_SIZE))  # below 8 the per-block bookkeeping dominates
    # Prefix caching (docs/prefix-cache.md): full blocks of compressed KV and indexer keys are reused by their
    # token-prefix hash, and the window rings are checkpointed at block boundaries, so a request starts prefill at
    # the longest cached boundary of its prompt (under YOCO, at most its known length - yoco.keep_tokens). null: on
    # (a hit is exact in every layout and YOCO mode), resolved once in the resolve step.
    prefix_caching: Optional[bool] = None
    # the share of the cache budget held by window checkpoints (each one slot's fixed state: rings, open groups,
    # Engram history); at least one checkpoint whenever prefix caching is on
    prefix_checkpoint_fraction: float = setting(0.1, allowed=Interval(0, 1, hi_open=True))
    # besides the end of each prompt (rounded down to a block): a checkpoint every this many blocks of a long
    # prompt (0: prompt ends only)
    prefix_checkpoint_interval: int = setting(16, allowed=up_to(0, 1 << 20))


@dataclass(frozen=True)
class RuntimeSettings:
    batch_invariant: bool = False  # DEEPINFER_BATCH_INVARIANT
    # Base of the per-request seeds of requests without seq_seed (request i draws with child_seed(seed, i));
    # null: each such request gets a fresh random seed (DeepInfer's behaviour).
    seed: Optional[int] = setting(None, allowed=UINT64)
    # torch intra-op CPU threads for this process (torch.set_num_threads); null: torch's default. Tiny models run
    # fastest with 1: their ops are too small to split, and spare threads only spin.
    num_threads: Optional[int] = setting(None, allowed=up_to(1, MAX_THREADS))
    # CUDA graphs for decode steps (DEEPINFER_ENFORCE_EAGER=1 turns them off), captured per batch-size bucket:
    # powers of two below the interval, then every `cudagraph_batch_size_interval` (DeepInfer's spacing, default 8)
    enforce_eager: bool = False  # DEEPINFER_ENFORCE_EAGER
    cudagraph_batch_size_interval: int = setting(8, allowed=up_to(1, 1024))  # DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL


@dataclass(frozen=True)
class SamplingDefaults:
    """Default SamplingParams of the CLI (and of LLM.generate when none are given), plus grammar limits.
    The defaults are SamplingParams' own (DeepInfer's: temperature 1.0, max_tokens 16, seq_seed None), restated
    here because the schema must not import torch; tests/test_config_defaults.py fails if the two drift."""

    temperature: float = setting(1.0, allowed=Interval(0, None, text="[0, inf) (below 1e-5 = greedy)"))
    top_p: float = setting(1.0, allowed=Interval(0, 1, lo_open=True))
    top_k: int = setting(-1, allowed=Interval(1, None, also=(-1,), text="-1 (off) or an integer >= 1"))
    min_p: float = setting(0.0, allowed=Interval(0, 1))
    max_tokens: int = setting(16, allowed=up_to(1, MAX_TOKENS))
    min_tokens: int = setting(0, allowed=up_to(0, MAX_TOKENS))
    ignore_eos: bool = False
    stop: Optional[List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    presence_penalty: float = setting(0.0, allowed=Interval(-2, 2))
    frequency_penalty: float = setting(0.0, allowed=Interval(-2, 2))
    repetition_penalty: float = setting(1.0, allowed=POSITIVE)
    logit_bias: Optional[Dict[int, float]] = None  # {token id: bias in [-100, 100]} added to the logits
    n: int = setting(1, allowed=up_to(1, 1024))
    top_logprobs: int = setting(0, allowed=Interval(0, 1000))
    prompt_logprobs: bool = False
    seq_seed: Optional[int] = setting(None, allowed=UINT64)
    logprobs: bool = True
    first_n_token_no_eos: int = setting(0, allowed=up_to(0, MAX_TOKENS))
    eos_id: Optional[int] = setting(None, allowed=NON_NEGATIVE)
    golden_token_ids: Optional[List[int]] = None
    xgrammar_timeout: float = setting(20.0, allowed=MAX_SECONDS)  # DEEPINFER_XGRAMMAR_TIMEOUT, seconds
    # DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES
    xgrammar_cache_limit_bytes: int = setting(1 << 30, allowed=up_to(0, MAX_CACHE_BYTES))
    # a JSON schema larger than this many bytes ends its request at once (sampling/grammar.py)
    xgrammar_max_schema_bytes: int = setting(1 << 20, allowed=up_to(1, MAX_CACHE_BYTES))
    # ... or with more JSON values than this (each enum value, property schema, keyword value counts one)
    xgrammar_max_schema_values: int = setting(32768, allowed=up_to(1, 1 << 30))
    # ... or whose grammar has more literal characters (its states, after the enum trie) than this: before compiling,
    # as a grammar's memory follows its states (sampling/grammar.py DEFAULT_MAX_GRAMMAR_STATES)
    xgrammar_max_grammar_states: int = setting(65536, allowed=up_to(1, 1 << 30))
    # heavy compilations (schemas over 16 KiB) run at once; one client runs at most this minus one (at least 1)
    xgrammar_heavy_lanes: int = setting(2, allowed=up_to(1, 64))
    # a server client's compilations waiting or running per lane; beyond: 429 (sampling/compile_queue.py)
    xgrammar_max_per_client: int = setting(4, allowed=up_to(1, 1024))
    # heavy grammars alive (compiled, held by their requests) past this many bytes: the next heavy compilation waits
    # for one to be released (0: one at a time); bounds the core's memory in a flood (a 10,000-value enum: 31 MiB)
    xgrammar_live_limit_bytes: int = setting(16 << 20, allowed=up_to(0, MAX_CACHE_BYTES))

    def params(self, **changes):
        """A SamplingParams from these defaults (grammar limits are engine-wide, not per request)."""
        from dataclasses import asdict

        from deepinfer.sampling.params import SamplingParams

        fields = {k: v for k, v in asdict(self).items() if not k.startswith("xgrammar_")}
        for key in ("stop", "stop_token_ids", "golden_token_ids"):
            if fields[key] is not None:
                fields[key] = list(fields[key])
        if fields["logit_bias"] is not None:
            fields["logit_bias"] = dict(fields["logit_bias"])
        fields.update(changes)
        return SamplingParams(**fields)


@dataclass(frozen=True)
class ServeSettings:
    """`serve=offline` (the default: run prompts, write outputs) or `serve=openai` (the HTTP server,
    deepinfer/serving). The server keys are read only by the server."""

    name: str = setting("offline", allowed=("offline", "openai"))
    host: str = "127.0.0.1"  # loopback: exposing the server is an explicit choice (serve.host=0.0.0.0)
    port: int = setting(8000, allowed=up_to(0, 65535))  # 0: any free port (printed at start)
    # requests accepted beyond engine.max_num_seqs; one more is answered 429 (the bound keeps memory and latency
    # bounded under overload instead of queueing without limit)
    max_queued_requests: int = setting(1024, allowed=up_to(0, 1 << 20))
    # the name(s) /v1/models lists and requests may use: a name, or a list of aliases (vLLM's --served-model-name);
    # null: the loaded model's identity (its directory name or hub id; deepinfer-embedded-NAME for an embedded one)
    served_model_name: Optional[Any] = None
    # thinking mode of requests that do not say (`thinking`, `reasoning_effort`, `reasoning.effort`); null: what
    # suits the loaded model (off for an embedded model, on for a DeepSeek checkpoint)
    default_thinking: Optional[bool] = None
    # SIGTERM/Ctrl-C drains: new requests get 503, open requests get this many seconds to finish, then streams end
    # with an error event and [DONE] (a second signal stops at once)
    shutdown_timeout: float = setting(5.0, allowed=MAX_SECONDS)
    # requests to /v1/* and /tokenize, /detokenize must carry it (Authorization: Bearer KEY or x-api-key: KEY);
    # null: no key (a warning at start when serve.host is not loopback). DEEPINFER_API_KEY sets it (conf/serve)
    api_key: Optional[str] = None
    log_level: str = setting("warning", allowed=("critical", "error", "warning", "info", "debug"))
    # ---- what one client may cost (serving/guard.py, serving/connections.py) ----
    # a request body larger than this is answered 413 before it is read in full (Content-Length, or counted as it
    # streams in), and before it is parsed
    max_body_bytes: int = setting(4 << 20, allowed=up_to(1024, 1 << 30))
    # seconds a connection may take to send a request's head (request line and headers), counted from its opening
    # or from the end of its previous response; then it is closed (a slow or silent sender)
    header_timeout: float = setting(10.0, allowed=MAX_SECONDS)
    # seconds a request's whole body may take to arrive once its head has; then 408 and the connection is closed
    body_timeout: float = setting(30.0, allowed=MAX_SECONDS)
    keep_alive_timeout: float = setting(5.0, allowed=MAX_SECONDS)  # seconds an idle keep-alive connection is kept
    # open connections beyond this are answered 503 and closed at once; null: 3/4 of the open-file limit (whose
    # soft value is raised to the hard one at start), at most 16384. Must stay below the open-file limit
    max_connections: Optional[int] = setting(None, allowed=up_to(1, 1 << 20))
    # Host header names accepted (a DNS-rebinding guard); "*": any. null: loopback names only when serve.host is
    # loopback, any otherwise (a warning at start then)
    allowed_hosts: Optional[List[str]] = None
    # browser origins (scheme://host[:port]) whose cross-origin requests are served, with CORS headers; "*": any.
    # A request with an Origin header not listed is answered 403. Empty: none
    allowed_origins: List[str] = setting(factory=list)
    # the server exits (code 1, one line) when its engine core dies or hangs, so a supervisor restarts it (vLLM's
    # behaviour), after keep_alive_timeout seconds of 503s with Connection: close; false: it stays up answering 503
    exit_on_engine_death: bool = True


@dataclass(frozen=True)
class Settings:
    """The whole resolved configuration. Top-level run keys drive the CLI."""

    hardware: HardwareSettings = field(default_factory=HardwareSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    decoding: DecodingSettings = field(default_factory=DecodingSettings)
    yoco: YocoSettings = field(default_factory=YocoSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    serve: ServeSettings = field(default_factory=ServeSettings)
    recipe: Optional[str] = None  # set by recipes/*.yaml, named in errors and the summary
    prompts: Optional[List[str]] = None  # CLI: prompts to run (default: a few built-in ones)
    input_path: Optional[str] = None  # CLI: a .jsonl file of {"prompt": ...} lines
    output_file: str = "outputs.jsonl"  # CLI: written in the Hydra run directory
