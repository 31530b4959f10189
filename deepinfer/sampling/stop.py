"""When a request stops, and its final text: EOS, stop_token_ids, stop strings, max_tokens, grammar termination.

Text is detokenized incrementally: only tokens after the last stable point are decoded again, and a decode that
ends in U+FFFD (an unfinished UTF-8 sequence split across byte-level tokens) waits for the next token. Stop strings
are searched in the newly stable text plus the len(stop) - 1 characters before it, so a stop string that spans
token boundaries is found as soon as its last character appears.
"""

from __future__ import annotations

from deepinfer.sampling.params import SamplingParams

_REPLACEMENT = "\ufffd"


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
        self._text_ids: list[int] = []  # ids whose text counts (a final stop token is excluded)
        self._prefix_offset = 0  # decode window start: a little context before the unread tokens
        self._read_offset = 0  # tokens before this are already in _text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def append(self, token_id: int, grammar_terminated: bool = False) -> str | None:
        """Takes one generated token; returns the finish reason once the request is finished, else None.
        grammar_terminated: the request's grammar has ended (its matcher is terminated)."""
        if self.finished:
            raise RuntimeError("StopChecker.append after the request finished")
        self.token_ids.append(token_id)
        may_stop = len(self.token_ids) > self.params.min_tokens
        if may_stop and token_id in self.stop_token_ids:
            return self._finish("stop")
        self._text_ids.append(token_id)
        searched = len(self._text)
        self._detokenize()
        if may_stop and self.stop_strings and self._cut_at_stop_string(searched):
            self.finish_reason = "stop"  # no flush: the text already ends where the stop string began
            return self.finish_reason
        if grammar_terminated:
            return self._finish("stop")
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish("length")
        return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _detokenize(self, flush: bool = False) -> None:
        ids = self._text_ids
        before = self._decode(ids[self._prefix_offset : self._read_offset])
        after = self._decode(ids[self._prefix_offset :])
        if len(after) > len(before) and (flush or not after.endswith(_REPLACEMENT)):
            self._text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def _cut_at_stop_string(self, searched: int) -> bool:
        start = max(0, searched - self._longest_stop + 1)
        hits = [i for i in (self._text.find(s, start) for s in self.stop_strings) if i >= 0]
        if not hits:
            return False
        self._text = self._text[: min(hits)]
        return True

    def _finish(self, reason: str) -> str:
        self._detokenize(flush=True)  # an unfinished UTF-8 tail becomes U+FFFD: nothing will complete it now
        self.finish_reason = reason
        return reason
