"""The one incremental detokenizer: `tokenizers`' DecodeStream, plus the flush a finished request needs.

DecodeStream decodes a small window of recent tokens and hands out only the new, stable text: a window that ends in
an unfinished UTF-8 sequence (a character split across byte-level tokens) waits for the next token. `flush()` ends
the stream: tokens still waiting become text, an unfinished character U+FFFD (nothing will complete it now). The
concatenated pieces equal `tokenizer.decode(all ids)`. Used by the StopChecker (engine core, sequential runner) and
by the frontend's output processor (RequestOutput.text, the server's streamed text).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """tokenizer: a tokenizers.Tokenizer (or a transformers fast tokenizer: its backend_tokenizer is used)."""

    __slots__ = ("tokenizer", "skip_special_tokens", "_stream", "_pending")

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # ids whose text is not out yet (an unfinished character)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def step(self, token_id: int) -> str:
        """The new stable text after this token ("" while a character is unfinished)."""
        self._pending.append(token_id)
        piece = self._stream.step(self.tokenizer, token_id)
        if piece:
            self._pending.clear()
            return piece
        return ""

    def flush(self) -> str:
        """The text of the tokens still waiting (U+FFFD for an unfinished character); the stream ends here."""
        if not self._pending:
            return ""
        text = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending = []
        return text
