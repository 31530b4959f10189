"""One request on the engine: its stream's outputs (text from the frontend's output processor) -> deepseek_recipe
chunks.

The HTTP status is decided before the first byte is sent: `start()` waits for the engine's first update (of every
sample of every prompt of the request), and a request the engine refuses at once (prompt too long, more cache than the budget, a schema that does not compile)
becomes a 400 with the engine's one-line message instead of a stream that starts and then fails (a 429 when the
engine refused it for load: RequestUpdate.busy; a 503 when the engine died meanwhile).
"""

from __future__ import annotations

import time

import deepseek_recipe as dr

from deepinfer.serving.errors import HTTPError
from deepinfer.serving.lifecycle import SHUTTING_DOWN

FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length,
          # aborted by the engine itself (e.g. shutting down): the text so far is the answer
          "abort": dr.InferenceFinishReason.Stop}


class RequestRun:
    """One engine request (one sample of one prompt). processor: the deepseek_recipe StreamProcessor its output
    feeds (chat-like endpoints; None for completions, which read `updates()`); token_logprobs: feed it token ids
    with their logprobs instead of text (the recipe writes the protocol's logprobs); drain: the server's
    lifecycle.Drain (a request it aborts at shutdown ends in a 503 error, not in a truncated answer)."""

    def __init__(self, engine, stream, prompt_len: int, metrics, processor=None, token_logprobs: bool = False,
                 drain=None):
        self.engine, self.stream, self.metrics, self.drain = engine, stream, metrics, drain
        self.prompt_len, self.processor, self.token_logprobs = prompt_len, processor, token_logprobs
        self.num_tokens = 0  # generated tokens taken from the stream so far (a final stop token included): usage
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held: usage
        self.response = None  # the protocol's response accumulator (non-streaming chat-like requests)
        self._first = None
        self._last_token_time: float | None = None
        self.finish_reason: str | None = None
        metrics.on_submit(prompt_len)

    async def start(self) -> None:
        """Waits for the request's first update; raises HTTPError if the engine refused it."""
        self._first = await self.stream.next()
        if self._first.finish_reason == "error" and not self._first.token_ids:
            self.metrics.on_finish("error", started=False)
            self.finish_reason = "error"
            self._raise_if_engine_dead()
            if self._first.busy:  # refused for load (a client's grammar compilations at their bound): retry later
                raise HTTPError(429, self._first.error or "the engine is busy", "rate_limit_exceeded")
            raise HTTPError(400, self._first.error or "the engine refused the request")

    def _raise_if_engine_dead(self) -> None:
        """A request ended by the engine's death is the server's unavailability (503, as the admission check
        answers), not the client's error (400) nor a failure of this request (500)."""
        dead = getattr(self.engine, "dead", None)
        if dead is not None:
            raise HTTPError(503, f"the engine is not serving: {dead}", "service_unavailable")

    async def updates(self):
        """Yields the stream's outputs (deepinfer.frontend.StreamOutput) until the request ends; an engine failure
        after the start raises HTTPError(500)."""
        upd, self._first = self._first, None
        while True:
            if upd.finish_reason == "error":
                self.finish_reason = "error"
                self.metrics.on_finish("error", started=self._last_token_time is not None)
                self._raise_if_engine_dead()
                raise HTTPError(500, f"the request failed in the engine: {upd.error}", "server_error")
            if upd.finish_reason == "abort" and self.drain is not None and self.drain.expired:
                self._observe(upd)
                self.num_tokens += len(upd.token_ids)
                self._end("abort")
                raise HTTPError(503, f"{SHUTTING_DOWN}: the request was stopped after {self.num_tokens} generated "
                                     "tokens", "service_unavailable")
            self._observe(upd)
            self.num_tokens += len(upd.token_ids)
            self.num_cached_tokens = max(self.num_cached_tokens, upd.num_cached_tokens)
            if upd.finish_reason is not None:  # ended before the last yield: a consumer may not resume after it
                self._end(upd.finish_reason)
                yield upd
                return
            yield upd
            upd = await self.stream.next()

    def stop_early(self) -> None:
        """The response ended before the engine did (a stop sequence the processor matched): free the request."""
        self.engine.abort(self.stream)
        if self.finish_reason is None:
            self._end("stop")

    def is_stop_token(self, token_id: int) -> bool:
        params = self.stream.state.input.params
        if token_id in (params.stop_token_ids or ()):
            return True
        return not params.ignore_eos and token_id == self.engine.info.eos_token_id

    async def chunks(self):
        """Yields the protocol's chunks (deepseek_recipe objects) until the request ends."""
        p = self.processor
        cached = self._first.num_cached_tokens if self._first is not None else 0  # prefix cache hits (usage)
        usage = dr.PromptUsage(prompt_tokens=self.prompt_len, prompt_cache_hit_tokens=cached)
        yield p.push(dr.InferenceChunk.ready(prompt_usage=usage))
        async for upd in self.updates():
            done = upd.finish_reason is not None
            if self.token_logprobs:
                ids, lps = list(upd.token_ids), list(upd.logprobs or [None] * len(upd.token_ids))
                stop_token = done and upd.finish_reason == "stop" and ids and self.is_stop_token(ids[-1])
                if stop_token:  # not part of the text (nor of OpenAI's logprobs); usage still counts it
                    ids, lps = ids[:-1], lps[:-1]
                if ids:
                    pairs = [(lp[0] if lp and lp[0] is not None else 0.0, list(lp[1] or []) if lp else [])
                             for lp in lps]
                    yield p.push(dr.InferenceChunk.tokens(ids, pairs))
                if stop_token:
                    yield p.push(dr.InferenceChunk.text("", 1))
            elif upd.text or upd.num_tokens:
                yield p.push(dr.InferenceChunk.text(upd.text, upd.num_tokens))
            if p.finished:  # a stop sequence matched in the answer: the processor has ended the response
                self.stop_early()
                return
            if done:
                yield p.push(dr.InferenceChunk.finish(FINISH[upd.finish_reason]))
                if not p.finished:
                    yield p.finish()
                return

    def _observe(self, upd) -> None:
        if not upd.token_ids:
            return
        now = time.perf_counter()
        if self._last_token_time is None:
            self.metrics.on_first_token(now - self.stream.arrival)
        else:
            self.metrics.on_tokens_gap((now - self._last_token_time) / len(upd.token_ids), len(upd.token_ids))
        self._last_token_time = now
        self.metrics.on_generated(len(upd.token_ids))

    def _end(self, reason: str) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.metrics.on_finish(reason, started=self._last_token_time is not None)
        self.metrics.on_request_end(time.perf_counter() - self.stream.arrival, self.prompt_len, self.num_tokens)

    def close(self) -> None:
        """The client went away (or the response ended early): a request still running is aborted, so the engine
        frees its cache."""
        if self.stream is not None and not self.stream.finished:
            self.engine.abort(self.stream)
            if self.finish_reason is None:
                self._end("abort")
