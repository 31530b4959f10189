"""Messages between the frontend and the engine core (pickled over the ipc socket, or passed in-process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AddRequest:
    request_id: int
    prompt_ids: list[int]
    params: Any  # SamplingParams
    seed: int  # resolved by the frontend: seq_seed, or derived from runtime.seed and the caller's request id


def request_error(msg) -> str | None:
    """Why a request cannot enter the engine core, or None: the same checks the frontend and SamplingParams make
    (one definition, in deepinfer.sampling.params), repeated where the request arrives."""
    from deepinfer.sampling.params import params_error

    ids = getattr(msg, "prompt_ids", None)
    if not isinstance(ids, (list, tuple)) or not all(type(t) is int for t in ids):
        return "prompt token ids must be a list of integers"
    if type(getattr(msg, "seed", None)) is not int:
        return "the request's seed must be an integer"
    return params_error(getattr(msg, "params", None))


@dataclass
class RequestUpdate:
    """New tokens of one request from one step; `finish_reason` set on its last update."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # per token: (logprob, top_logprobs) or None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    prompt_logprobs: list | None = None  # once, with the first token, when the params ask for them
    # speculative decoding (DSpark): drafts verified in this update's step and how many of them were accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def _kernel_stats() -> dict:
    from deepinfer.kernels.registry import kernel_stats

    return kernel_stats()


@dataclass
class StepStats:
    """What one engine step did; the frontend folds these into the run's metrics."""

    step_id: int
    num_rows: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    device_start: float  # perf_counter in the engine process, forward + sample only
    device_end: float
    schedule_s: float  # CPU time planning this step
    update_s: float  # CPU time turning its samples into updates
    prepare_s: float  # runner-side Python: batch inputs and sampler rows (inside the device interval)
    cache_utilization: float
    graph: bool = False  # the forward replayed a captured CUDA graph
    num_draft_tokens: int = 0  # DSpark drafts verified in this step
    num_accepted_tokens: int = 0  # of which accepted
    accepted_lengths: list = field(default_factory=list)  # per verifying request: drafts accepted (histogram input)
    replay_rows_saved: int = 0  # YOCO compact: decoder-layer rows not computed in this step's prefill
    # the engine process's kernel counters so far (per-call torch fallbacks, JIT compiles / cache hits / seconds),
    # read where the step is recorded: deepinfer.kernels.registry.kernel_stats
    kernels: dict = field(default_factory=_kernel_stats)

@dataclass
class CoreOutputs:
    updates: list[RequestUpdate]
    stats: list[StepStats] = field(default_factory=list)


@dataclass(frozen=True)
class CoreInfo:
    """Sent once by the engine core when it is ready."""

    max_model_len: int
    capacity_tokens: int
    num_blocks: int
    block_size: int
    cache_description: str
    vocab_size: int
    eos_token_id: int | None
    zero_overhead: bool
