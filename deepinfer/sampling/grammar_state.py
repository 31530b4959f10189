"""Structured outputs, per-request side: where the request is in its grammar, and the mask for its next token.

Phases (so_args with trigger_token_ids / bound_token_id):
  free     no trigger seen yet: any token; the grammar waits (e.g. through a reasoning block)
  forcing  bound_token_id was sampled: the rest of the trigger sequence is forced, one token per step
  active   the trigger is in the output (or there is none): xgrammar's matcher decides the mask
Without a trigger the state starts active. Every accepted token records the phase it left, so ``rollback``
undoes free and forced tokens as well as grammar tokens (speculative decoding rejects drafts this way).
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from deepinfer.sampling.bitmask import set_single_token_
from deepinfer.sampling.utf8_guard import Utf8Guard

FREE, FORCING, ACTIVE = "free", "forcing", "active"


class GrammarState:
    """One request's grammar progress (made by ``GrammarCompilerPool.submit``). Not thread-safe: the engine's step
    loop owns it; ``fill_bitmask`` may run while the model computes, ``accept_token`` after the draw."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        trigger_token_ids: list[int] | None = None,
        bound_token_id: int | None = None,
        utf8_guard: Utf8Guard | None = None,
    ):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.utf8_guard = utf8_guard
        self._utf8 = Utf8Guard.START  # UTF-8 decoder state of the bytes the grammar has accepted
        self.trigger = list(trigger_token_ids or [])
        self.bound_token_id = bound_token_id
        self.phase = FREE if self.trigger else ACTIVE
        self._forced = 0  # trigger tokens already in the output while forcing
        self._tokens: list[int] = []  # every accepted token, for trigger detection
        # per token: (phase before, forced before, UTF-8 state before, matcher took it)
        self._history: list[tuple[str, int, int, bool]] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (a CPU int32 xgrammar bitmask, all-allowed on entry)."""
        if self.phase == FORCING:
            set_single_token_(bitmask, row, self.trigger[self._forced])
        elif self.phase == ACTIVE and self.matcher.is_terminated():
            bitmask[row].zero_()  # nothing may follow; xgrammar would raise, taking the whole batch down
        elif self.phase == ACTIVE:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            if self.utf8_guard is not None:
                self.utf8_guard.restrict_(bitmask, row, self._utf8)

    def accept_token(self, token_id: int) -> bool:
        """Advances by one generated token; False (and no change) when the grammar does not allow it."""
        before = (self.phase, self._forced, self._utf8)
        by_matcher = self.phase == ACTIVE
        if by_matcher:
            if not self.matcher.accept_token(token_id):
                return False
            if self.utf8_guard is not None:
                self._utf8 = self.utf8_guard.advance(self._utf8, token_id)
        elif self.phase == FORCING:
            if token_id != self.trigger[self._forced]:
                return False
            self._forced += 1
            if self._forced == len(self.trigger):
                self.phase = ACTIVE
        self._tokens.append(token_id)
        if before[0] == FREE:
            self._watch_for_trigger(token_id)
        self._history.append((*before, by_matcher))
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last num_tokens accepted tokens (all phases)."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"rollback({num_tokens}) is out of range; allowed: [0, {len(self._history)}]")
        matcher_tokens = 0
        for _ in range(num_tokens):
            self.phase, self._forced, self._utf8, by_matcher = self._history.pop()
            self._tokens.pop()
            matcher_tokens += by_matcher
        if matcher_tokens:
            self.matcher.rollback(matcher_tokens)

    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted its stop token): the request is complete."""
        return self.phase == ACTIVE and self.matcher.is_terminated()

    @property
    def num_accepted(self) -> int:
        return len(self._history)

    def _watch_for_trigger(self, token_id: int) -> None:
        n = len(self.trigger)
        if self._tokens[-n:] == self.trigger:
            self.phase = ACTIVE
        elif token_id == self.bound_token_id:
            # Force what is missing of the trigger: the output may already end with its first tokens (typically
            # the bound token is the trigger's first token).
            done = next((k for k in range(n - 1, 0, -1) if self._tokens[-k:] == self.trigger[:k]), 0)
            self.phase, self._forced = FORCING, done
