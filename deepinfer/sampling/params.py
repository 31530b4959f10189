"""SamplingParams: what a request asks of the sample stage, validated when it is built and again where it enters
the engine.

Validation is defined here, once: `SamplingParams.__post_init__` runs it so that a bad request fails in the
caller's frame with a message that names the field, the value and the allowed range. A dataclass field can be
reassigned after construction (`p.max_tokens = None`), so the engine runs the same checks again through
`params_error` when the request arrives, and ends only that request with the message.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass

from deepinfer.sampling.schema_limits import depth_error

UINT64_MAX = (1 << 64) - 1
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is argmax
MAX_TOP_LOGPROBS = 1000
SO_SCHEMA_TYPES = ("json", "regex", "ebnf")
_SO_KEYS = {"schema_type", "schema", "trigger_token_ids", "bound_token_id"}


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 60, 60, 60


def _shown(value) -> str:
    # reprlib: bounded in length and nesting, so a huge or deeply nested value never makes a huge (or recursing) error
    return _SHORT.repr(value)


def _bad(field: str, value, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{field}={_shown(value)} is out of range; allowed: {allowed}")


def _is_int(value) -> bool:
    # bool is an int subclass; True as a token count is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM-style names; DeepInfer's fields plus the ones users miss).

    temperature: 1.0; below 1e-5 the draw is greedy (argmax, ties go to the lowest token id).
    top_p: nucleus mass in (0, 1]. top_k: -1 (off) or >= 1. min_p: [0, 1], relative to the most likely token.
    max_tokens: >= 1 generated tokens at most. min_tokens: EOS and stop_token_ids are suppressed (and stop strings
        ignored) until this many tokens exist; at most max_tokens.
    ignore_eos: EOS does not end the request (stop_token_ids and stop strings still do).
    stop: strings that end the request; the returned text excludes them. stop_token_ids: token ids that do.
    presence_penalty, frequency_penalty: [-2, 2], subtracted from the logits of tokens already generated.
    repetition_penalty: > 0; 1.0 is off; applied to tokens of the prompt and of the output.
    logit_bias: {token_id: bias in [-100, 100]} added to the token's logit before sampling (OpenAI's and vLLM's
        logit_bias; reported logprobs stay the model's own); None or {} is off.
    n: independent samples per prompt (see ``deepinfer.sampling.seeds.child_seed``).
    top_logprobs: 0..1000 alternatives reported per generated token (0 = none; the chosen token's logprob is
        always reported). prompt_logprobs: report the logprob of every prompt token (top-N as top_logprobs).
    so_args: structured output, {"schema_type": "json"|"regex"|"ebnf", "schema": str (or dict for json),
        optional "trigger_token_ids": [int, ...], "bound_token_id": int}.
    seq_seed: uint64 seed of the request's random draws; None = a fresh random seed drawn when the engine admits
        the request (``deepinfer.sampling.seeds.request_seed``).
    logprobs: report each generated token's logprob (RequestOutput.logprobs); False: none are reported unless
        top_logprobs > 0 (DeepInfer's field; its own default False is kept by deepinfer.sampling_params).
    first_n_token_no_eos: the token eos_id cannot be drawn as any of the first n generated tokens (DeepInfer).
    eos_id: the token first_n_token_no_eos suppresses; None = the model's EOS (DeepInfer's engine overwrites the
        field with the tokenizer's EOS, which None reproduces). It does not change what ends the request.
    golden_token_ids: forced output: generated token i is golden_token_ids[i] (teacher forcing; its logprob is
        reported and stops apply as to a drawn token), then sampling continues. Each id must be in the vocabulary.
    max_tokens=0 is DeepInfer's spelling of 1 (one token, the prefill's): it becomes 1.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    so_args: dict | None = None
    seq_seed: int | None = None
    logprobs: bool = True
    first_n_token_no_eos: int = 0
    eos_id: int | None = None
    golden_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a lone string is a common, unambiguous shorthand
            self.stop = [self.stop]
        if self.max_tokens == 0 and _is_int(self.max_tokens):  # DeepInfer: 0 means the one prefill token
            self.max_tokens = 1
        self.validate()

    @property
    def reports_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    def validate(self) -> None:
        """Raises a one-line ValueError for the first field out of range."""
        self._validate_numbers()
        self._validate_lists()
        if self.so_args is not None:
            _validate_so_args(self.so_args)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _validate_numbers(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "[0, inf) (below 1e-5 = greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", self.top_p, "(0, 1]")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise _bad("top_k", self.top_k, "-1 (off) or an integer >= 1")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", self.min_p, "[0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise _bad(name, value, "[-2, 2]")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", self.repetition_penalty, "(0, inf) (1.0 = off)")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "an integer >= 1")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", self.top_logprobs, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
        if not isinstance(self.prompt_logprobs, bool):
            raise _bad("prompt_logprobs", self.prompt_logprobs, "True or False")
        if self.seq_seed is not None and (not _is_int(self.seq_seed) or not 0 <= self.seq_seed <= UINT64_MAX):
            raise _bad("seq_seed", self.seq_seed, "None or an integer in [0, 2**64 - 1]")
        if not isinstance(self.logprobs, bool):
            raise _bad("logprobs", self.logprobs, "True or False")
        if not _is_int(self.first_n_token_no_eos) or self.first_n_token_no_eos < 0:
            raise _bad("first_n_token_no_eos", self.first_n_token_no_eos, "an integer >= 0")
        if self.eos_id is not None and (not _is_int(self.eos_id) or self.eos_id < 0):
            raise _bad("eos_id", self.eos_id, "None (the model's EOS) or a token id >= 0")

    def _validate_lists(self) -> None:
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise _bad("stop", self.stop, "None or a list of non-empty strings")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise _bad("stop_token_ids", self.stop_token_ids, "None or a list of token ids >= 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()
            ):
                raise _bad("logit_bias", self.logit_bias, "None or {token id >= 0: a bias in [-100, 100]}")
        if self.golden_token_ids is not None:
            if not isinstance(self.golden_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.golden_token_ids
            ):
                raise _bad("golden_token_ids", self.golden_token_ids, "None or a list of token ids >= 0")


def params_error(params) -> str | None:
    """The one-line reason `params` cannot run, or None: the constructor's checks, for objects that may have been
    changed after they were built (or are not SamplingParams at all)."""
    if not isinstance(params, SamplingParams):
        return f"sampling params must be a SamplingParams; got {type(params).__name__}"
    try:
        params.validate()
    except Exception as error:  # a field of any type may have been assigned: never let it escape
        return " ".join(str(error).split()) or type(error).__name__
    return None


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(SamplingParams)]


def params_from_dict(data: dict, cls: type = None) -> tuple["SamplingParams | None", str | None]:
    """(SamplingParams(**data), None), or (None, a one-line reason): an unknown field is named with the allowed
    ones; a bad value gets the constructor's message. For data from outside Python (a JSONL line, the engine
    socket), where a TypeError for an unknown keyword would be the wrong kind of answer."""
    cls = cls or SamplingParams
    if not isinstance(data, dict):
        return None, f"sampling params must be a dict of SamplingParams fields; got {type(data).__name__}"
    allowed = field_names()
    unknown = [k for k in data if k not in allowed]
    if unknown:
        return None, f"unknown SamplingParams field {_shown(unknown[0])}; allowed: {', '.join(allowed)}"
    try:
        return cls(**data), None
    except Exception as error:  # values of any type: never let it escape
        return None, " ".join(str(error).split()) or type(error).__name__


def _validate_so_args(so_args) -> None:
    """Checks the shape of so_args; whether the schema compiles is the grammar compiler's business."""
    if not isinstance(so_args, dict):
        raise _bad("so_args", so_args, "None or a dict with schema_type and schema")
    unknown = set(so_args) - _SO_KEYS
    if unknown:
        raise _bad("so_args", so_args, f"keys among {sorted(_SO_KEYS)}; unknown: {sorted(unknown)}")
    schema_type = so_args.get("schema_type")
    if schema_type not in SO_SCHEMA_TYPES:
        raise _bad("so_args['schema_type']", schema_type, " | ".join(SO_SCHEMA_TYPES))
    schema = so_args.get("schema")
    allowed_schema = (str, dict) if schema_type == "json" else (str,)
    if not isinstance(schema, allowed_schema):
        kinds = "a str or a dict" if schema_type == "json" else "a str"
        raise _bad("so_args['schema']", schema, f"{kinds} for schema_type={schema_type!r}")
    too_deep = depth_error(schema)
    if too_deep is not None:  # before anything recursive (repr, pickle, json) touches it
        raise ValueError(f"SamplingParams.so_args['schema'] is {too_deep}")
    trigger = so_args.get("trigger_token_ids")
    if trigger is not None and (
        not isinstance(trigger, list) or not trigger or not all(_is_int(t) and t >= 0 for t in trigger)
    ):
        raise _bad("so_args['trigger_token_ids']", trigger, "None or a non-empty list of token ids >= 0")
    bound = so_args.get("bound_token_id")
    if bound is not None:
        if not _is_int(bound) or bound < 0:
            raise _bad("so_args['bound_token_id']", bound, "None or a token id >= 0")
        if trigger is None:
            raise _bad("so_args['bound_token_id']", bound, "only together with trigger_token_ids")
