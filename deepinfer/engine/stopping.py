"""When a request stops, decided in the engine core right after each sampled token.

Requests with stop strings need text, so they use the sampling room's StopChecker (incremental detokenization).
All others use TokenStop, which applies the same rules without decoding anything: detokenizing every token in the
step loop would be pure scheduling overhead, and the frontend detokenizes for the user anyway.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Stopper(Protocol):
    def append(self, token_id: int, grammar_terminated: bool = False) -> str | None: ...


class TokenStop:
    """EOS (unless ignore_eos) and stop_token_ids end a request once at least min_tokens tokens came before the
    stopping one; a finished grammar ends it with "stop"; max_tokens ends it with "length". Same rules and order
    as deepinfer.sampling.StopChecker."""

    def __init__(self, params: Any, eos_token_id: int | None):
        self.max_tokens = params.max_tokens
        self.min_tokens = getattr(params, "min_tokens", 0) or 0
        stops = set(getattr(params, "stop_token_ids", None) or ())
        if eos_token_id is not None and not getattr(params, "ignore_eos", False):
            stops.add(eos_token_id)
        self.stop_ids = frozenset(stops)
        self.count = 0

    def append(self, token_id: int, grammar_terminated: bool = False) -> str | None:
        self.count += 1
        if self.count > self.min_tokens and token_id in self.stop_ids:
            return "stop"
        if grammar_terminated:
            return "stop"
        if self.count >= self.max_tokens:
            return "length"
        return None


def stopper_factory(eos_token_id: int | None, tokenizer=None) -> Callable[[Any], Stopper]:
    """Returns params -> a fresh Stopper. Raises ValueError for stop strings when there is no tokenizer."""

    def make(params: Any) -> Stopper:
        if getattr(params, "stop", None):
            if tokenizer is None:
                raise ValueError("stop strings need a tokenizer, and this engine was built without one")
            from deepinfer.sampling.stop import StopChecker

            return StopChecker(params, tokenizer, eos_token_id)
        return TokenStop(params, eos_token_id)

    return make
