"""The output processor: the engine core's RequestUpdates -> text and RequestOutputs, for every frontend.

One RequestState per engine request follows its updates: tokens, logprobs, speculative counts, times. Its text comes
from the one incremental detokenizer (deepinfer.sampling.detokenize: tokenizers' DecodeStream) inside a StopChecker
fed as tokens arrive, so the text ends exactly where the engine core stopped: the final stop token (EOS, a
stop_token_id) left out, cut before a stop string. A request that ended before its checker did (aborted, an error,
the model's length limit) shows everything generated. The server streams `text_delta()`s (special tokens kept:
deepseek_recipe reads `</think>` and the tool-call markup from the text); LLM returns `output()`s, grouped per prompt
by `request_outputs` (n samples -> RequestOutput.samples).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

from deepinfer.frontend.input_processor import EngineInput
from deepinfer.outputs import RequestMetrics, RequestOutput, TokenLogprob
from deepinfer.sampling.stop import StopChecker


class RequestState:
    """Frontend-side record of one engine request. `run`: the per-call RunMetrics (or None); `inbox`: where the
    loop that owns it learns of its news (LLMEngine: a list per stream; AsyncEngine: the request's EngineStream)."""

    def __init__(self, inp: EngineInput, tokenizer, eos_token_id: int | None, skip_special_tokens: bool = True,
                 run=None, inbox: list | None = None):
        self.input = inp
        self.engine_id: int | None = None
        self.run, self.inbox = run, inbox
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.finish_reason: str | None = "error" if inp.error is not None else None
        self.error = inp.error
        self.busy = False  # ended by a refusal for load (RequestUpdate.busy)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_cached_tokens = 0
        now = time.perf_counter()
        self.metrics = RequestMetrics(arrival_time=now, num_prompt_tokens=len(inp.prompt_ids))
        if inp.error is not None:
            self.metrics.finish_time = now
        self.new_token_ids: list[int] = []  # arrived since the owner last looked (take_new)
        self._checker = None
        if tokenizer is not None and inp.error is None:
            self._checker = StopChecker(inp.params, tokenizer, eos_token_id, skip_special_tokens)
        self._sent = 0  # characters handed out by text_delta
        self._unsent_tokens = 0  # tokens whose text text_delta has not accounted for yet

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, upd, now: float) -> None:
        """Folds one RequestUpdate in."""
        if upd.prompt_logprobs is not None:
            self.prompt_logprobs = [None if s is None else TokenLogprob(s.token_id, s.logprob, s.top_logprobs)
                                    for s in upd.prompt_logprobs]
        self.num_draft_tokens += upd.num_draft_tokens
        self.num_accepted_tokens += upd.num_accepted_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, upd.num_cached_tokens)
        if upd.token_ids:
            self.token_ids += upd.token_ids
            self.logprobs += upd.logprobs
            self.new_token_ids += upd.token_ids
            self._unsent_tokens += len(upd.token_ids)
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            checker = self._checker
            if checker is not None:
                for tok in upd.token_ids:
                    if checker.finished:
                        break
                    checker.append(tok)
        if upd.finish_reason is not None:
            self.finish_reason, self.error, self.busy = upd.finish_reason, upd.error, upd.busy
            self.metrics.finish_time = now
            if self._checker is not None and not self._checker.finished:
                self._checker.flush()  # ended before its checker did: everything generated is text

    def fail(self, message: str) -> None:
        """Ends a request the core will not answer any more (the engine is gone)."""
        self.finish_reason, self.error = "error", message
        self.metrics.finish_time = time.perf_counter()
        if self._checker is not None and not self._checker.finished:
            self._checker.flush()

    def take_new(self) -> list[int]:
        new, self.new_token_ids = self.new_token_ids, []
        return new

    @property
    def text(self) -> str:
        return self._checker.text if self._checker is not None and self.token_ids else ""

    def text_delta(self) -> tuple[str, int]:
        """Text new since the last call and how many tokens it accounts for (a token that only began a character
        is counted with the text that completes it; at the end every token, a final stop token included)."""
        if self._checker is None:
            return "", 0
        shown = self._checker.text if self.finished else self._checker.streamable_text
        text, self._sent = shown[self._sent:], max(self._sent, len(shown))
        count = 0
        if text or self.finished:
            count, self._unsent_tokens = self._unsent_tokens, 0
        return text, count

    def output(self) -> RequestOutput:
        inp = self.input
        logprobs = None
        if self.logprobs and all(lp is not None for lp in self.logprobs):
            logprobs = [TokenLogprob(tok, lp[0], lp[1]) for tok, lp in zip(self.token_ids, self.logprobs)]
        self.metrics.num_output_tokens = len(self.token_ids)
        return RequestOutput(
            request_id=inp.request_id,
            prompt=inp.prompt,
            prompt_token_ids=inp.prompt_ids,
            text=self.text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            error=self.error,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


class OutputProcessor:
    """The states of the requests in flight, by engine id, and the one place the core's updates are folded in.
    tokenizer: a tokenizers.Tokenizer for output text (None: text is ""). skip_special_tokens: False for the server
    (its protocol parser reads the special tokens)."""

    def __init__(self, tokenizer, eos_token_id: int | None, skip_special_tokens: bool = True):
        self.tokenizer, self.eos_token_id, self.skip_special_tokens = tokenizer, eos_token_id, skip_special_tokens
        self.states: dict[int, RequestState] = {}

    def new_state(self, inp: EngineInput, engine_id: int, run=None, inbox=None) -> RequestState:
        """The state of a new request; registered unless the input processor already refused it (then it is
        finished). inbox: anything with append(state), told of every change (the loop waiting on the request)."""
        st = RequestState(inp, self.tokenizer, self.eos_token_id, self.skip_special_tokens, run, inbox)
        st.engine_id = engine_id
        if run is not None:
            run.on_submit(engine_id, len(inp.prompt_ids))
        if not st.finished:
            self.states[engine_id] = st
        return st

    def process(self, updates, now: float) -> None:
        """Folds a batch of RequestUpdates into their states (updates of requests no longer followed are
        dropped); a finished request stops being followed; each changed state goes to its inbox."""
        for upd in updates:
            st = self.states.get(upd.request_id)
            if st is None:
                continue
            st.apply(upd, now)
            if upd.token_ids and st.run is not None:
                st.run.on_tokens(upd.request_id, len(upd.token_ids), now)
            if upd.finish_reason is not None:
                del self.states[upd.request_id]
            if st.inbox is not None:
                st.inbox.append(st)

    def fail_all(self, message: str) -> None:
        """The engine is gone: every request followed ends with `message`."""
        states, self.states = list(self.states.values()), {}
        for st in states:
            st.fail(message)
            if st.inbox is not None:
                st.inbox.append(st)


def request_outputs(states: Iterable[RequestState], only_finished: bool = False) -> list[RequestOutput]:
    """One RequestOutput per prompt, in input order; a prompt's n samples go into its `samples` (its own fields are
    sample 0's). only_finished: leave out prompts with a sample still running."""
    per_prompt: dict[int, list[RequestState]] = {}
    for st in states:
        per_prompt.setdefault(st.input.index, []).append(st)
    outputs = []
    for index in sorted(per_prompt):
        group = sorted(per_prompt[index], key=lambda s: s.input.sample)
        if only_finished and not all(s.finished for s in group):
            continue
        outs = [s.output() for s in group]
        outputs.append(outs[0] if len(outs) == 1 else dataclasses.replace(outs[0], samples=outs))
    return outputs
