"""Incremental detokenization of one request's tokens with `tokenizers`' DecodeStream.

Special tokens are kept in the text (skip_special_tokens=False): `</think>` and the DSML tool-call markup are
special tokens of DeepSeek-V4.1, and deepseek_recipe's stream parser reads them from the text. The final stop token
(EOS, a stop_token_id) is left out, as LLMEngine leaves it out of RequestOutput.text.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalText:
    def __init__(self, tokenizer, stop_ids: set[int]):
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self._stream = DecodeStream(skip_special_tokens=False)
        self._pending_tokens = 0  # tokens whose bytes did not complete a character yet (a multi-byte UTF-8 char)
        self.num_tokens = 0

    def add(self, token_ids: list[int], finished: bool) -> tuple[str, int]:
        """Text of the new tokens and how many tokens it accounts for. `finished`: the last of them ended the
        request (a stop token there is not text)."""
        if finished and token_ids and token_ids[-1] in self.stop_ids:
            token_ids = token_ids[:-1]
            self.num_tokens += 1  # generated, so counted in usage, but not text
            self._pending_tokens += 1
        pieces = []
        for tok in token_ids:
            self.num_tokens += 1
            self._pending_tokens += 1
            piece = self._stream.step(self.tokenizer, tok)
            if piece:
                pieces.append(piece)
        text = "".join(pieces)
        count = 0
        if text or finished:
            count, self._pending_tokens = self._pending_tokens, 0
        return text, count
