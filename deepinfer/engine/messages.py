"""Messages between the frontend and the engine core: typed msgspec structs, passed as they are in-process and
encoded as MessagePack over the ipc socket (deepinfer.engine.ipc), never pickled.

Every frame on the socket is one of the tagged control messages at the end of this file; a decoder built for one
direction accepts only that direction's types, so a frame of any other shape (a pickle, a wrong type, an unknown
message kind) fails to decode and is dropped and logged by the receiver (ipc.Verifier). Decoding MessagePack only
ever builds plain values and these structs: no code from the wire runs.

The request's SamplingParams travel as their field dict and are rebuilt on arrival through SamplingParams' own
constructor (deepinfer.sampling.params.params_from_dict), so one malformed request ends alone with the same
one-line error the frontend would have given, instead of taking the whole frame (and its neighbours) down.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from deepinfer.sampling.logprobs import SampleOutput
from deepinfer.sampling.params import SamplingParams


class ImageInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One image of a request as it travels to the engine core, decoded and resized once by the frontend
    (frontend/images.py, off the core's loop): Pillow's resized pixels (uint8 RGB, row-major, height x width x 3;
    not yet centred or normalised, which the model does on its device when the ViT runs), the canvas they are
    centred on (whole patches; it fixes the ViT and LLM grids), and the span of the expanded prompt its rows fill:
    positions [start, start + length) (VISION_SPEC.md §6.1)."""

    start: int
    length: int
    canvas_width: int
    canvas_height: int
    width: int
    height: int
    pixels: bytes


class AddRequest(msgspec.Struct, frozen=True):
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # resolved by the frontend: seq_seed, or derived from runtime.seed and the caller's request id
    # the prompt's images, in prompt order; prompt_ids hold each one's span (vocab+2, then vocab+1s)
    images: list[ImageInput] = msgspec.field(default_factory=list)
    cache_salt: Optional[str] = None  # prefix caching: only requests with the same salt share cached prefixes
    # who sent it (the server: the client's address; "" for the offline API): grammar compilations are shared
    # fairly between clients and bounded per client (sampling/compile_queue.py)
    client: str = ""


def request_error(msg) -> str | None:
    """Why a request cannot enter the engine core, or None: the same checks the frontend and SamplingParams make
    (one definition, in deepinfer.sampling.params), repeated where the request arrives."""
    from deepinfer.engine.prefix_cache import cache_salt_error
    from deepinfer.sampling.params import params_error

    ids = getattr(msg, "prompt_ids", None)
    if not isinstance(ids, (list, tuple)) or not all(type(t) is int for t in ids):
        return "prompt token ids must be a list of integers"
    if type(getattr(msg, "seed", None)) is not int:
        return "the request's seed must be an integer"
    images = getattr(msg, "images", [])
    if not isinstance(images, (list, tuple)) or not all(isinstance(im, ImageInput) for im in images):
        return "the request's images must be a list of ImageInput"
    return cache_salt_error(getattr(msg, "cache_salt", None)) or params_error(getattr(msg, "params", None))


# (logprob, top_logprobs) of one generated token, or None
TokenLogprobs = Optional[tuple[Optional[float], Optional[list[tuple[int, float]]]]]


class RequestUpdate(msgspec.Struct):
    """New tokens of one request from one step; `finish_reason` set on its last update."""

    request_id: int
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)  # per token: (logprob, top_logprobs)
    finish_reason: Optional[str] = None  # stop | length | abort | error
    error: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[SampleOutput]]] = None  # once, with the first token, when asked
    # speculative decoding (DSpark): drafts verified in this update's step and how many of them were accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # seconds from the request's arrival in the core to its first admission, on its first update with tokens
    queued_s: Optional[float] = None
    # prefix caching: prompt tokens found cached when the request was first admitted (sent with its first tokens)
    num_cached_tokens: int = 0
    busy: bool = False  # the error is a refusal for load (retry later; HTTP 429), not about what the request asks


def _kernel_stats() -> dict:
    from deepinfer.kernels.registry import kernel_stats

    return kernel_stats()


class StepStats(msgspec.Struct):
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
    draft_graph: bool = False  # DSpark drafting replayed a captured CUDA graph
    num_draft_tokens: int = 0  # DSpark drafts verified in this step
    num_accepted_tokens: int = 0  # of which accepted
    accepted_lengths: list[int] = msgspec.field(default_factory=list)  # per verifying request: drafts accepted
    replay_rows_saved: int = 0  # YOCO compact: decoder-layer rows not computed in this step's prefill
    # prefix caching: tokens the step's admissions looked up and found cached; the cache's counters so far
    # (CacheManager.prefix_stats: evictions, checkpoints, bytes they hold), None when prefix caching is off
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cache: Optional[dict[str, int]] = None
    # the engine process's kernel counters so far (per-call torch fallbacks, JIT compiles / cache hits / seconds),
    # read where the step is recorded: deepinfer.kernels.registry.kernel_stats
    kernels: dict[str, Any] = msgspec.field(default_factory=_kernel_stats)


class CoreOutputs(msgspec.Struct):
    updates: list[RequestUpdate]
    stats: list[StepStats] = msgspec.field(default_factory=list)


class CoreInfo(msgspec.Struct, frozen=True):
    """Sent once by the engine core when it is ready."""

    max_model_len: int
    capacity_tokens: int
    num_blocks: int
    block_size: int
    cache_description: str
    vocab_size: int
    eos_token_id: Optional[int]
    zero_overhead: bool


# ---- control messages: what one frame on the socket holds ---------------------------------------------------
class _Control(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    pass


# frontend -> core
class WireRequest(msgspec.Struct, frozen=True):
    """An AddRequest as it travels. request_id must be an integer (or the whole frame is malformed: nobody could
    be told); the other fields are checked per request by `from_wire`, so a bad one ends only its request."""

    request_id: int
    prompt_ids: Any
    params: Any
    seed: Any
    images: Any = msgspec.field(default_factory=list)
    cache_salt: Any = None
    client: Any = ""


class Add(_Control, tag="add"):
    requests: list[WireRequest]


class Abort(_Control, tag="abort"):
    request_ids: list[int]


class Ping(_Control, tag="ping"):
    pass


class Shutdown(_Control, tag="shutdown"):
    pass


# core -> frontend
class Hello(_Control, tag="hello"):
    pid: int


class Ready(_Control, tag="ready"):
    info: CoreInfo


class Failure(_Control, tag="failure"):
    """The core could not start (`startup` true) or its step loop died; `line` for the user, `details` the
    traceback."""

    line: str
    details: str
    startup: bool


class Pong(_Control, tag="pong"):
    pass


class Outputs(_Control, tag="outputs"):
    outputs: CoreOutputs


# heartbeat thread -> frontend
class Heartbeat(_Control, tag="heartbeat"):
    sent: float  # time.monotonic() in the core (same clock as the frontend's: one machine)
    loop_age: Optional[float]  # seconds since the step loop last turned; None while the core starts


TO_CORE = Union[Add, Abort, Ping, Shutdown]
TO_FRONTEND = Union[Hello, Ready, Failure, Pong, Outputs]
HEARTBEAT = Heartbeat


def to_wire(requests: list[AddRequest]) -> Add:
    """The frame for these requests; params go as their field dict (SamplingParams is a plain dataclass)."""
    return Add([WireRequest(r.request_id, r.prompt_ids, _params_dict(r.params), r.seed, r.images, r.cache_salt,
                             r.client)
                for r in requests])


def _params_dict(params) -> Any:
    import dataclasses

    if isinstance(params, SamplingParams):
        return {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
    return params  # not params at all: the core answers the request with the error, as in-process


def from_wire(req: WireRequest) -> AddRequest | RequestUpdate:
    """The AddRequest, or the update that ends this request alone with a one-line error."""
    from deepinfer.engine.prefix_cache import cache_salt_error
    from deepinfer.sampling.params import params_from_dict

    ids, seed = req.prompt_ids, req.seed
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        return RequestUpdate(req.request_id, finish_reason="error", error="prompt token ids must be a list of integers")
    if type(seed) is not int:
        return RequestUpdate(req.request_id, finish_reason="error", error="the request's seed must be an integer")
    if not isinstance(req.params, dict):
        error = f"sampling params must be a SamplingParams; got {type(req.params).__name__}"
        return RequestUpdate(req.request_id, finish_reason="error", error=error)
    try:
        images = msgspec.convert(req.images, list[ImageInput])
    except msgspec.ValidationError as exc:
        error = f"the request's images must be a list of ImageInput ({exc})"
        return RequestUpdate(req.request_id, finish_reason="error", error=error)
    error = cache_salt_error(req.cache_salt)
    if error is not None:
        return RequestUpdate(req.request_id, finish_reason="error", error=error)
    params, error = params_from_dict(req.params)
    if error is not None:
        return RequestUpdate(req.request_id, finish_reason="error", error=error)
    client = req.client if isinstance(req.client, str) else ""  # only a fairness tag: a bad one is no client
    return AddRequest(req.request_id, ids, params, seed, images, req.cache_salt, client[:200])
