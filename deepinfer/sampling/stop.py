"""When a request stops, and its final text: EOS, stop_token_ids, stop strings, max_tokens, grammar termination.

Text is detokenized incrementally by the one IncrementalDetokenizer (tokenizers' DecodeStream): a decode that ends in
an unfinished UTF-8 sequence (split across byte-level tokens) waits for the next token. Stop strings
are searched in the newly stable text plus the len(stop) - 1 characters before it, so a stop string that spans
token boundaries is found as soon as its last character appears.
"""

from __future__ import annotations

from deepinfer.sampling.detokenize import IncrementalDetokenizer
from deepinfer.sampling.params import SamplingParams


class StopChecker:
    """One per request (per sub-request when n > 1). Feed every generated token to ``append``.

    After it finishes: ``finish_reason`` is "stop" or "length", ``token_ids`` are all generated ids (a final
    EOS / stop token included), ``text`` is their detokenization without the stop token and cut before the
    first stop string. Stops (EOS, stop tokens, stop strings) count only for tokens at position >= min_tokens.
    tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` (tokenizers.Tokenizer or a transformers one).
    """

    def __init__(self, params: SamplingParams, tokenizer, eos_token_id: int | None, skip_special_tokens=True):
        self.params = params
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_token_ids = set(params.stop_token_ids or [])
        if eos_token_id is not None and not params.ignore_eos:
            self.stop_token_ids.add(eos_token_id)
        self.stop_strings = list(params.stop or [])
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._text = ""
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)  # a final stop token is never fed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    @property
    def streamable_text(self) -> str:
        """Text safe to show while generating (the frontend's text deltas): holds back a tail that could still
        become a stop string."""
        if self.finished or self._longest_stop <= 1:
            return self._text
        return self._text[: max(0, len(self._text) - (self._longest_stop - 1))]

    def append(self, token_id: int, grammar_terminated: bool = False) -> str | None:
        """Takes one generated token; returns the finish reason once the request is finished, else None.
        grammar_terminated: the request's grammar has ended (its matcher is terminated)."""
        if self.finished:
            raise RuntimeError("StopChecker.append after the request finished")
        self.token_ids.append(token_id)
        may_stop = len(self.token_ids) > self.params.min_tokens
        if may_stop and token_id in self.stop_token_ids:
            return self._finish("stop")
        searched = len(self._text)
        self._text += self._detok.step(token_id)
        if may_stop and self.stop_strings and self._cut_at_stop_string(searched):
            self.finish_reason = "stop"  # no flush: the text already ends where the stop string began
            return self.finish_reason
        if grammar_terminated:
            return self._finish("stop")
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish("length")
        return None

    def _cut_at_stop_string(self, searched: int) -> bool:
        start = max(0, searched - self._longest_stop + 1)
        hits = [i for i in (self._text.find(s, start) for s in self.stop_strings) if i >= 0]
        if not hits:
            return False
        self._text = self._text[: min(hits)]
        return True

    def flush(self) -> str:
        """The request ended elsewhere (aborted, an error, a limit this checker does not know): the tokens still
        waiting become text (an unfinished UTF-8 tail U+FFFD). Returns the final text."""
        self._text += self._detok.flush()
        return self._text

    def _finish(self, reason: str) -> str:
        self.flush()  # an unfinished UTF-8 tail becomes U+FFFD: nothing will complete it now
        self.finish_reason = reason
        return reason
