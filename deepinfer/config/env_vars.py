"""DeepInfer's environment variables: which ones this project honours, and a warning for every other one that is set.

The honoured ones are read in the YAML through ${oc.env:...} (so `--cfg job` shows their effect) or, for paths that
exist before any config (caches, the model directory), where they are used. A DEEPINFER_* variable that is set but
not honoured (DeepInfer has many: NCCL, profiling, multimodal ...) gets one warning line naming it at start, never
silence; so does a DSpark variable set while decoding=plain ignores it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("deepinfer.config")

# name -> where it is honoured
HONOURED = {
    "DEEPINFER_BATCH_INVARIANT": "runtime.batch_invariant",
    "DEEPINFER_PREFIX_CACHING": "cache.prefix_caching (this project's: 1/true on, 0/false off)",
    "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "engine.zero_overhead_scheduling",
    "DEEPINFER_ENFORCE_EAGER": "runtime.enforce_eager",
    "DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL": "runtime.cudagraph_batch_size_interval",
    "DEEPINFER_XGRAMMAR_TIMEOUT": "sampling.xgrammar_timeout",
    "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES": "sampling.xgrammar_cache_limit_bytes",
    "DEEPINFER_JIT_CACHE_DIR": "TileLang kernel cache",
    "DEEPINFER_PDL": "programmatic dependent launch of the TileLang kernels (on by default; 0/false/off turns it off)",
    "DEEPINFER_CACHE_DIR": "embedded model cache",
    "DEEPINFER_HF_MODEL_DIR": "model.path (a local copy of the hub checkpoint)",
    "DEEPINFER_MAX_BACKTRACKING_TOKENS": "decoding.max_backtracking_tokens",
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "yoco.mode",
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "yoco.keep_tokens",
    "DEEPINFER_USE_NEXTN_DECODE": "decoding.num_draft_tokens",
    "DEEPINFER_ENABLE_MTP_VARLEN": "decoding.varlen",
    "DEEPINFER_DECODE_PERF_CACHE_DIR": "decoding.perf_cache_dir",
    "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE": "decoding.confidence_temperature",
    "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "parallel.eplb.redundant_experts",
    "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "parallel.eplb.window",
    "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "parallel.eplb.interval",
    "DEEPINFER_GLOO_TIMEOUT": "parallel.timeout",
    "DEEPINFER_API_KEY": "serve.api_key (serve=openai)",
    "DEEPINFER_ENGRAM_FORCE_GPU_STORAGE": "model.engram_storage (1: device, 0: host)",
}
DSPARK_ONLY = ("DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_ENABLE_MTP_VARLEN", "DEEPINFER_DECODE_PERF_CACHE_DIR",
               "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE")
# read by the multi-rank layouts' files (conf/parallel/dep*.yaml, cp*.yaml), not by parallel=single
PARALLEL_ONLY = ("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE",
                 "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL", "DEEPINFER_GLOO_TIMEOUT")

_warned: set[str] = set()


def unhonoured(environ=None, decoding: str = "plain", world_size: int = 1) -> list[tuple[str, str]]:
    """(name, why) for every DEEPINFER_* variable set in `environ` that this run does not honour (world_size: the
    parallel layout's ranks)."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(n for n in env if n.startswith("DEEPINFER_")):
        if name not in HONOURED:
            out.append((name, "not honoured by this project (DeepInfer 0.1.0 reads it)"))
        elif name in DSPARK_ONLY and decoding != "dspark":
            out.append((name, f"ignored with decoding={decoding}; it configures decoding=dspark"))
        elif name in PARALLEL_ONLY and world_size == 1:
            out.append((name, "ignored with one rank (parallel=single); it configures the parallel layouts"))
    return out


def warn_unhonoured(decoding: str = "plain", world_size: int = 1) -> None:
    """One warning line per variable, once per process."""
    for name, why in unhonoured(decoding=decoding, world_size=world_size):
        if name not in _warned:
            _warned.add(name)
            log.warning("%s is set but %s", name, why)


def confidence_temperatures(default, num_draft_tokens: int) -> list[float]:
    """DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE: "t" (every draft position) or "t1,...,tN" (N = drafts)."""
    from deepinfer.config.errors import ConfigError

    raw = os.environ.get("DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE")
    if raw is None:
        return list(default)
    try:
        values = [float(x) for x in raw.split(",")]
    except ValueError:
        raise ConfigError(f"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE={raw!r}; allowed: a number > 0 or "
                          f"{num_draft_tokens} comma-separated numbers > 0") from None
    if len(values) not in (1, num_draft_tokens) or not all(v > 0 for v in values):
        raise ConfigError(f"DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE={raw!r}; allowed: a number > 0 or "
                          f"{num_draft_tokens} comma-separated numbers > 0 (one per draft position)")
    return values
