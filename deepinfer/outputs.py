"""What generate() returns: one RequestOutput per prompt, in input order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one token (generated or prompt) and, when asked, the top-N alternatives."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None = None

@dataclass
class RequestMetrics:
    """Times in seconds (time.perf_counter clock) and token counts of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

@dataclass
class RequestOutput:
    """finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the model's length
    limit), "abort" (cancelled), "error" (the request could not run; `error` says why, the other requests of
    the batch are unaffected)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed for this request)
    metrics: RequestMetrics | None = None
    # SamplingParams.n > 1: all n independent samples (this output's own fields are those of sample 0)
    samples: list["RequestOutput"] | None = None

    @property
    def finished(self) -> bool:
        return True

    def to_json(self) -> dict:
        """A JSON-ready dict (outputs.jsonl lines)."""
        m = self.metrics
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "logprobs": None if self.logprobs is None else [[t.token_id, t.logprob] for t in self.logprobs],
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "time_to_first_token": None if m is None else m.time_to_first_token,
            "e2e_latency": None if m is None else m.e2e_latency,
            **({"samples": [o.to_json() for o in self.samples]} if self.samples else {}),
        }


def error_output(request_id: int, prompt: str | None, prompt_ids: list[int], message: str) -> RequestOutput:
    import time

    now = time.perf_counter()
    metrics = RequestMetrics(arrival_time=now, finish_time=now, num_prompt_tokens=len(prompt_ids))
    return RequestOutput(request_id, prompt, list(prompt_ids), "", [], "error", error=message, metrics=metrics)


@dataclass(frozen=True)
class StreamUpdate:
    """What LLM.generate_iter yields. index: the prompt's position in the input. token_ids: tokens new since the last
    update of that prompt (sample 0 of n). output: None while it runs; the final RequestOutput once everything has
    finished (one update per prompt, in input order)."""

    index: int
    token_ids: list[int]
    output: Any = None
