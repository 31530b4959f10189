"""One request on the engine: its stream's outputs (text from the frontend's output processor) -> deepseek_recipe
chunks.

The HTTP status is decided before the first byte is sent: `start()` waits for the engine's first update, and a
request the engine refuses at once (prompt too long, more cache than the budget, a schema that does not compile)
becomes a 400 with the engine's one-line message instead of a stream that starts and then fails.
"""

from __future__ import annotations

import time

import deepseek_recipe as dr

from deepinfer.serving.errors import HTTPError

FINISH = {"stop": dr.InferenceFinishReason.Stop, "length": dr.InferenceFinishReason.Length,
          # aborted by the engine itself (e.g. shutting down): the text so far is the answer
          "abort": dr.InferenceFinishReason.Stop}


class RequestRun:
    def __init__(self, engine, prepared, metrics):
        self.engine, self.prepared, self.metrics = engine, prepared, metrics
        self.stream = None
        self.num_tokens = 0  # generated tokens taken from the stream so far (a final stop token included): usage
        self._first = None
        self._last_token_time: float | None = None
        self.finish_reason: str | None = None

    async def start(self) -> None:
        """Submits the request and waits for its first update; raises HTTPError if the engine refuses it."""
        self.stream = self.engine.submit(self.prepared.prompt_ids, self.prepared.params)
        self.metrics.on_submit(len(self.prepared.prompt_ids))
        self._first = await self.stream.next()
        if self._first.finish_reason == "error" and not self._first.token_ids:
            self.metrics.on_finish("error", started=False)
            raise HTTPError(400, self._first.error or "the engine refused the request")

    async def chunks(self):
        """Yields the protocol's chunks (deepseek_recipe objects) until the request ends."""
        p = self.prepared.processor
        yield p.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=len(self.prepared.prompt_ids))))
        upd, self._first = self._first, None
        while True:
            if upd.finish_reason == "error":
                self.finish_reason = "error"
                self.metrics.on_finish("error", started=self._last_token_time is not None)
                raise HTTPError(500, f"the request failed in the engine: {upd.error}", "server_error")
            self._observe(upd)
            self.num_tokens += len(upd.token_ids)
            done = upd.finish_reason is not None
            if upd.text or upd.num_tokens:
                yield p.push(dr.InferenceChunk.text(upd.text, upd.num_tokens))
            if p.finished:  # a stop sequence matched in the answer: the processor has ended the response
                self.engine.abort(self.stream)
                self._end("stop")
                return
            if done:
                yield p.push(dr.InferenceChunk.finish(FINISH[upd.finish_reason]))
                if not p.finished:
                    yield p.finish()
                self._end(upd.finish_reason)
                return
            upd = await self.stream.next()

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
        self.finish_reason = reason
        self.metrics.on_finish(reason, started=self._last_token_time is not None)

    def close(self) -> None:
        """The client went away (or the response ended early): a request still running is aborted, so the engine
        frees its cache."""
        if self.stream is not None and not self.stream.finished:
            self.engine.abort(self.stream)
            if self.finish_reason is None:
                self.finish_reason = "abort"
                self.metrics.on_finish("abort", started=self._last_token_time is not None)
