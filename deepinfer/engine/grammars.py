"""Structured outputs in the engine core: compiling each request's grammar off the step loop, and keeping the
request's GrammarState consistent with its tokens.

The compiler pool lives in the engine-core process (a GrammarState wraps an xgrammar matcher, which cannot be
pickled) and is built on the first request with so_args, so engines that never see one pay nothing for it.
The step loop only polls: `settle()` returns the requests whose compilation ended since the last call.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

log = logging.getLogger(__name__)


class GrammarCompilations:
    """so_args -> GrammarState, one Future per request. backend: the EngineBackend (tokenizer, vocab, EOS);
    options: EngineOptions (xgrammar_*: timeout, cache limit, schema limits, lanes, per-client bound)."""

    def __init__(self, backend, options):
        self._backend = backend
        self._options = options
        self._pool = None
        self._pending: dict[int, Future] = {}
        # Set by a context-parallel core, which waits for each grammar as its request arrives: a compilation waiting
        # for live grammars to be released would wait for requests that cannot run meanwhile, so no live bound
        self.synchronous = False

    def submit(self, request_id: int, so_args: dict, alive=None, client: str = "") -> str | None:
        """Starts compiling; returns why structured outputs are impossible here (no tokenizer), else None.
        alive(): whether the request still exists (a compilation still queued for an aborted one is skipped);
        client: who sent the request (AddRequest.client), for the queue's fairness and per-client bound."""
        if self._pool is None:
            if self._backend.tokenizer is None or not hasattr(self._backend.tokenizer, "to_str"):
                return "structured outputs need the model's tokenizers.Tokenizer, and this engine has none"
            from deepinfer.sampling.grammar import GrammarCompilerPool

            limits = dict(self._options.grammar_limits)
            if self.synchronous:
                log.warning("sampling.xgrammar_live_limit_bytes does not apply under context parallel: each grammar "
                            "compiles as its request arrives, and the core waits for it")
                limits["live_limit_bytes"] = None

            # The logits' width (the model's vocab_size), not the tokenizer's: padding ids are never allowed.
            self._pool = GrammarCompilerPool.for_tokenizer(
                self._backend.tokenizer, self._backend.vocab_size, self._backend.eos_token_id, **limits)
        self._pending[request_id] = self._pool.submit(so_args, alive=alive, client=client)
        return None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def settle(self) -> list[tuple[int, Any, BaseException | None]]:
        """(request_id, GrammarState or None, the GrammarError or None) for every compilation that has ended."""
        done = []
        for rid, fut in list(self._pending.items()):
            if fut.done():
                del self._pending[rid]
                exc = fut.exception()
                done.append((rid, None, exc) if exc is not None else (rid, fut.result(), None))
        return done

    def wait(self, request_id: int) -> None:
        """Blocks until the request's compilation has ended (a failure or timeout is reported by settle())."""
        fut = self._pending.get(request_id)
        if fut is not None:
            wait([fut])

    def wait_any(self, timeout_s: float) -> None:
        """Sleeps until some compilation ends (or timeout_s): for a loop that has nothing else to do."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def sync_grammar(state, output_ids: list[int]) -> str | None:
    """Makes `state` have accepted exactly `output_ids`; returns an error message if it cannot.

    The state has accepted every token sampled for the request, the request's output is those tokens minus the
    ones dropped after a preemption (async scheduling drops the token of a step in flight when its request was
    preempted), so the state is ahead by that tail: roll it back. Replaying covers a state that is behind."""
    accepted = state.num_accepted
    if accepted > len(output_ids):
        state.rollback(accepted - len(output_ids))
    for token_id in output_ids[accepted:]:
        if not state.accept_token(token_id):
            return f"the grammar rejected token {token_id} while replaying the request's output"
    return None
