"""Scheduler: decides, step by step, which requests run and how many of their tokens. Pure Python.

One step under a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs), in this order:
  1. decode rows: every running request whose prompt is done gets its next token (oldest first). When its next
     cache block does not fit, the newest running request is preempted (state dropped, recomputed later) until it
     does; a request that is itself the newest preempts itself.
  2. prefill chunks: running requests part-way through their prompt continue, as far as the budget goes.
  3. admission: waiting requests join in arrival order (preempted ones first) while the budget, the sequence cap
     and the cache allow; none join in a step that preempted, so a freed request is not immediately readmitted.
A request's cache is reserved for everything known about it at admission (prompt, or prompt + outputs after a
preemption), then grows one block at a time as it decodes. A request that could never fit (prompt + max_tokens
over max_model_len or over the whole cache) ends at once with finish_reason="error".

A request whose grammar is still compiling (structured outputs) is never sampled: its prefill runs up to, but not
including, its last known token, which waits (as a one-token row) until the grammar is ready; a one-token prompt
is admitted only then, and later requests are admitted past it.

Prefix caching (engine/prefix_cache.py): a request admitted with cached prefix blocks and a window checkpoint at
boundary b starts at b (its first row restores the checkpoint into its slot). The request's checkpoint boundaries
(its prompt's end rounded down to a block, where it leaves a cached prefix, every `checkpoint_interval` blocks)
that have no checkpoint yet are copied from its slot right after the step whose row reaches them, or runs at most
`checkpoint_lag` tokens past them (the pools keep that many rows behind a sequence, so the slot still holds the
window at the boundary); a chunk that would run further past one ends there. Chunk splits never change outputs.

Async scheduling plans step N+1 before step N's tokens are back: a request that step N samples for counts one
placeholder token (`num_pending`), which the next decode row feeds without knowing its id.

DSpark speculative decoding: a decode row also verifies up to `num_drafts` drafts the runner made after the
previous sample (all num_draft_tokens of them, or as many as the confidence-scheduled planner gives the request).
The row costs 1 + num_drafts tokens of the budget and reserves cache for every draft it might accept, also those
of a row still in flight (`draft_slack`); when its sample comes back, the accepted drafts join the output ahead of
the sampled token and count as computed (their cache entries were written by the verification).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.messages import RequestUpdate
from deepinfer.engine.plan import NewSequence, ScheduledRow, StepPlan, StepResult
from deepinfer.engine.prefix_cache import NO_HIT, extend_hashes, image_root, root_key
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.stopping import Stopper, TokenStop


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        vocab_size: int,
        stopper: Callable[[Any], Stopper] | None = None,
        eos_token_id: int | None = None,
        num_draft_tokens: int = 0,
        planner=None,
        checkpoint_interval: int = 0,
        checkpoint_lag: int = 0,
        replay_keep: int = 0,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 2:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, max_model_len >= 2")
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._make_stopper = stopper or (lambda params: TokenStop(params, eos_token_id))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._stoppers: dict[int, Stopper] = {}
        self._release: list[int] = []  # states the runner must drop before the next step
        self._next_step = 0
        self.num_preemptions = 0
        self.num_draft_tokens = num_draft_tokens
        self.planner = planner  # deepinfer.engine.spec_schedule.VarlenPlanner, or None: verify every draft
        self.checkpoint_interval = checkpoint_interval  # blocks between a long prompt's window checkpoints (0: none)
        # tokens a row may run past a checkpoint boundary and still leave the window at it in its slot (the pools
        # keep that many rows behind each sequence: CacheLayout's checkpoint_lag); more than that cuts the chunk
        if not 0 <= checkpoint_lag < cache.block_size:
            raise ValueError(f"checkpoint_lag={checkpoint_lag}; allowed: 0..{cache.block_size - 1} (under a block)")
        self.checkpoint_lag = checkpoint_lag
        # YOCO (models/replay.py): the decoder layers' window rows of a sequence before its rectangle (known length
        # - keep) are cut or never written, in the sequence and so in its checkpoints; a hit ends at or before the
        # request's own rectangle, where its decoder layers read nothing from before the boundary
        self.replay_keep = replay_keep
        self._root = root_key()
        self._lost: set[int] = set()  # requests whose state a failed step dropped (their later rows were skipped)

    # ---- arrivals ------------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: Any, images=()) -> str | None:
        """Why this request can never run, or None. Checked on arrival, before it takes any resource. `images`:
        the request's PromptImages, whose span positions hold ids past the vocabulary (engine/images.py)."""
        n = len(prompt_ids)
        if n == 0:
            return "the prompt is empty"
        text = prompt_ids
        if images:  # the span ids were checked with the images; every other id is text
            text = [t for i, t in enumerate(prompt_ids) if not any(im.start <= i < im.end for im in images)]
        bad = next((t for t in text if not (0 <= t < self.vocab_size)), None)
        if bad is not None:
            return f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        if n >= self.max_model_len:
            return f"the prompt has {n} tokens; max_model_len is {self.max_model_len}, which leaves no room to generate"
        if n + params.max_tokens > self.max_model_len:
            return (
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        # The last sampled token is never fed back, so the state holds at most n + max_tokens - 1 tokens.
        if not self.cache.fits_alone(n + params.max_tokens - 1):
            return (
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs more cache than the whole budget "
                f"holds ({self.cache.capacity_tokens} tokens for one sequence)"
            )
        return None

    def add(self, request: Request) -> RequestUpdate | None:
        """Queues a request; returns its final (error) update at once when it can never run."""
        error = self.validate(request.prompt_ids, request.params, request.images)
        if error is None:
            try:
                self._stoppers[request.request_id] = self._make_stopper(request.params)
            except ValueError as exc:
                error = str(exc)
        if error is not None:
            request.status = RequestStatus.FINISHED
            request.finish_reason, request.error = "error", error
            return RequestUpdate(request.request_id, finish_reason="error", error=error)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.cache.prefix is not None:
            root = self._root if request.cache_salt is None else root_key(request.cache_salt)
            request.hash_root = image_root(root, request.images) if request.images else root
            extend_hashes(request.block_hashes, request.hash_root, request.prompt_ids, self.cache.block_size)
        return None

    def abort(self, request_id: int) -> RequestUpdate | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort")
        return RequestUpdate(request_id, finish_reason="abort")

    def fail(self, request_id: int, error: str, busy: bool = False) -> RequestUpdate | None:
        """Ends one request with finish_reason="error" (e.g. its grammar did not compile); others go on. busy:
        refused for load, not for what it asks (RequestUpdate.busy)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "error", error)
        return RequestUpdate(request_id, finish_reason="error", error=error, busy=busy)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def take_release(self) -> list[int]:
        """States to drop now (when no further step will carry them)."""
        out, self._release = self._release, []
        return out

    # ---- planning ------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(step_id=self._next_step, rows=[])
        self._next_step += 1
        budget = self.max_num_batched_tokens
        preempted = False

        drafts = self._plan_drafts() if self.num_draft_tokens else {}
        for req in list(self.running):  # 1. decodes, oldest first
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.num_tokens - req.num_computed != 1:
                continue
            if not req.may_sample:
                continue  # its grammar is compiling: the row that samples waits
            if req.num_generated >= req.max_tokens:
                continue  # the in-flight step samples its last token
            k = min(drafts.get(req.request_id, 0), budget - 1)
            # the cache for everything this row and an in-flight one may accept (never past prompt + max_tokens)
            target = max(req.num_computed + 1,
                         min(req.num_computed + 1 + k + req.draft_slack, len(req.prompt_ids) + req.max_tokens))
            while not self.cache.can_hold(req.request_id, target):
                victim = self.running[-1]
                self._preempt(victim, plan)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it was the newest: every request after it is gone too
            self.cache.reserve(req.request_id, target)
            plan.rows.append(self._row(req, 1, num_drafts=k))
            plan.num_decode_tokens += 1 + k
            budget -= 1 + k
            self._name_prefix(req, plan, plan.rows[-1].start)

        for req in self.running:  # 2. prefill chunks of admitted requests (their cache is reserved already)
            if budget == 0:
                break
            remaining = req.num_tokens - req.num_computed
            if remaining > 1:
                n = self._cut(req, min(remaining, budget, remaining if req.may_sample else remaining - 1))
                plan.rows.append(self._row(req, n))
                plan.num_prefill_tokens += n
                budget -= n
                self._name_prefix(req, plan, plan.rows[-1].start)

        i = 0
        while i < len(self.waiting) and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]  # 3. admission, first come first served
            need = req.num_known
            if need == 1 and not req.may_sample:
                i += 1  # nothing to prefill before its grammar is ready: do not hold up the requests behind it
                continue
            want_lp = bool(getattr(req.params, "prompt_logprobs", False)) and not req.prompt_logprobs_sent
            # a cached prefix, never the whole known sequence (the last token computes the logits) nor, before
            # its grammar is ready, the last two (the row before the sampling one needs a token); prompt logprobs
            # need every prompt row's logits; under YOCO, never past the request's rectangle (need - keep)
            hit = NO_HIT if want_lp else self.cache.match(
                req.block_hashes, need - max(1 if req.may_sample else 2, self.replay_keep))
            if not self.cache.can_hold(req.request_id, need, hit):
                break
            self.cache.reserve(req.request_id, need, hit)
            cached = hit.num_blocks * self.cache.block_size
            req.branch_point = hit.matched * self.cache.block_size if hit.matched > hit.num_blocks else 0
            self.cache.count_lookup(need, hit)
            plan.prefix_query_tokens += need if self.cache.prefix is not None else 0
            plan.prefix_hit_tokens += cached
            if req.epoch == 0:
                req.num_cached_tokens = cached
            req.num_computed = cached
            del self.waiting[i]
            req.status = RequestStatus.RUNNING
            if req.queued_s is None:
                req.queued_s = time.perf_counter() - req.arrival
            self.running.append(req)
            new = NewSequence(tuple(req.all_ids()), len(req.prompt_ids), req.params, req.seed, want_lp, cached,
                              hit.checkpoint, tuple(req.images))
            left = need - cached
            n = self._cut(req, min(left, budget, left if req.may_sample else left - 1))
            plan.rows.append(self._row(req, n, new))
            plan.num_prefill_tokens += n
            budget -= n
            self._name_prefix(req, plan, plan.rows[-1].start)

        plan.release = self.take_release()
        return plan

    # ---- prefix caching -----------------------------------------------------------------------------------
    def _boundaries(self, req: Request) -> list[int]:
        """Where the request's window is checkpointed, in order: every checkpoint_interval blocks of its prompt,
        where its prompt leaves the cached blocks it found (a shared system prompt, found cached by the second
        request that sends it), and its prompt's end rounded down to a block (the next turn of a chat)."""
        bs = self.cache.block_size
        end = len(req.prompt_ids) // bs * bs
        step = self.checkpoint_interval * bs
        out = set(range(step, end, step)) if step else set()
        out.update(b for b in (req.branch_point, end) if b)
        return sorted(out)

    def _cut(self, req: Request, n: int) -> int:
        """A prefill chunk of n tokens, shortened to end at the first checkpoint boundary inside it that has no
        checkpoint yet, unless the chunk ends at most checkpoint_lag tokens past it (the runner copies the window
        right after the step: the pools still hold it then). With the lag a block, a prompt's end never cuts."""
        if self.cache.prefix is None or not self.cache.checkpoint_slots:
            return n
        start, bs = req.num_computed, self.cache.block_size
        for b in self._boundaries(req):
            if (start < b < start + n and start + n - b > self.checkpoint_lag
                    and not self.cache.has_checkpoint(req.block_hashes[b // bs - 1])):
                return b - start
        return n

    def _is_boundary(self, req: Request, b: int) -> bool:
        """Whether b is one of `_boundaries(req)`, in constant time (asked for every row of every step)."""
        bs = self.cache.block_size
        end, step = len(req.prompt_ids) // bs * bs, self.checkpoint_interval * bs
        return b > 0 and (b == end or b == req.branch_point or (step > 0 and b % step == 0 and b < end))

    def _checkpoint_boundary(self, req: Request, start: int, done: int) -> int:
        """The checkpoint boundary whose window a row over [start, done) leaves in the slot: one in (start, done]
        at most checkpoint_lag tokens behind `done`, or 0. Boundaries are block-aligned and the lag is under a
        block, so the only candidate is the last block boundary at or before `done`."""
        b = done // self.cache.block_size * self.cache.block_size
        return b if b > max(start, done - self.checkpoint_lag - 1) and self._is_boundary(req, b) else 0

    def _name_prefix(self, req: Request, plan: StepPlan, start: int) -> None:
        """After a row over [start, ...) is planned: its blocks that are now full of known tokens join the prefix
        index, and a sequence that now holds a checkpoint boundary (exactly, or up to checkpoint_lag tokens past
        it) has its slot copied after the step: the window at the boundary, as a restore finds it (every slot
        row is addressed by position; the rows past the boundary are overwritten before any read)."""
        if self.cache.prefix is None:
            return
        bs, done = self.cache.block_size, min(req.num_computed, req.num_known)
        if done // bs > len(req.block_hashes):
            extend_hashes(req.block_hashes, req.hash_root, req.all_ids()[:done], bs)
        rid = req.request_id
        plan.named_blocks += [(rid, h) for h in self.cache.name_blocks(rid, req.block_hashes, done)]
        b = self._checkpoint_boundary(req, start, done) if done == req.num_computed else 0
        if b:
            h = req.block_hashes[b // bs - 1]
            slot = self.cache.take_checkpoint(h)
            if slot >= 0:
                plan.snapshots.append((self.cache.slot_of(rid), slot))
                plan.named_checkpoints.append((rid, h))

    def _settle_prefix(self, plan: StepPlan) -> None:
        """What the step's rows named may be matched now, except what rows of requests whose state a failed step
        lost named: their rows were skipped (a plan made before the failure was known), nothing was written."""
        lost = self._lost
        for ok in (True, False):
            self.cache.settle([h for rid, h in plan.named_blocks if (rid not in lost) == ok],
                              [h for rid, h in plan.named_checkpoints if (rid not in lost) == ok], ok=ok)

    def _plan_drafts(self) -> dict[int, int]:
        """request id -> drafts its next decode row verifies: all of them, or the planner's share (confidences
        from two steps back size the step, from the last step rank the requests)."""
        reqs = [r for r in self.running if r.may_sample and r.num_generated < r.max_tokens]
        B = self.num_draft_tokens
        if self.planner is None:
            return {r.request_id: B for r in reqs}
        paired = [r.num_pending == 0 for r in reqs]  # no row in flight: `rates` are the last step's
        budget_rates = [r.prev_rates if p else r.rates for r, p in zip(reqs, paired)]
        max_k = [max(0, min(B, r.max_tokens - r.num_generated - 1)) for r in reqs]
        ks = self.planner.plan(budget_rates, [r.rates for r in reqs], max_k)
        return {r.request_id: k for r, k in zip(reqs, ks)}

    def _row(self, req: Request, n: int, new: NewSequence | None = None, num_drafts: int = 0) -> ScheduledRow:
        start, end, known = req.num_computed, req.num_computed + n, req.num_known
        ids = _slice(req, start, min(end, known))
        placeholder = end > known  # only a decode right after an in-flight sample: end == known + 1
        sample = end == req.num_tokens
        req.num_computed = end
        if sample:
            req.num_pending += 1
        req.draft_slack += num_drafts
        grammar = req.grammar_state if sample else None
        rid = req.request_id
        return ScheduledRow(rid, req.epoch, start, ids, placeholder, sample, new, self.cache.slot_of(rid),
                            self.cache.take_new_blocks(rid), grammar, num_drafts)

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self.cache.free(req.request_id)
        self._release.append(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.num_pending = 0  # a sample still in flight belongs to the dropped state: `epoch` discards it
        req.draft_slack = 0
        req.rates, req.prev_rates = [], []
        req.epoch += 1
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.num_preempted += 1
        self.waiting.appendleft(req)

    # ---- results -------------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Folds a finished step's samples into the requests; returns one update per request that changed."""
        updates: list[RequestUpdate] = []
        if result.error is not None:
            self._lost.update(row.request_id for row in plan.rows)
        self._settle_prefix(plan)
        if result.error is not None:
            for row in plan.rows:
                req = self.requests.get(row.request_id)
                if req is not None and req.epoch == row.epoch:
                    self._finish(req, "error", result.error)
                    updates.append(RequestUpdate(req.request_id, finish_reason="error", error=result.error))
            return updates
        samples = iter(result.samples)
        for row in plan.rows:
            if not row.sample:
                continue
            s = next(samples)
            req = self.requests.get(row.request_id)
            if req is None or req.epoch != row.epoch:
                continue  # finished or preempted after this step was planned: the token is not part of it
            req.num_pending -= 1
            req.draft_slack -= row.num_drafts
            if getattr(s, "error", None):
                self._finish(req, "error", s.error)
                updates.append(RequestUpdate(req.request_id, finish_reason="error", error=s.error))
                continue
            accepted = getattr(s, "accepted", ())
            req.num_computed += len(accepted)  # verified in the cache by this step
            if s.rates:
                req.prev_rates, req.rates = req.rates, list(s.rates)
            upd = RequestUpdate(req.request_id, num_draft_tokens=s.num_draft_tokens,
                                num_accepted_tokens=len(accepted),
                                num_cached_tokens=0 if req.output_ids else req.num_cached_tokens)
            if not req.queue_time_sent:
                upd.queued_s, req.queue_time_sent = req.queued_s, True
            req.num_draft_tokens += s.num_draft_tokens
            req.num_accepted_tokens += len(accepted)
            reason = None
            tokens = [(t, lp, top, False) for t, lp, top in accepted] + [
                (s.token_id, s.logprob, s.top_logprobs, s.grammar_terminated)]
            for token_id, logprob, top, terminated in tokens:  # a stop ends the request: later tokens are dropped
                req.output_ids.append(token_id)
                upd.token_ids.append(token_id)
                upd.logprobs.append(None if logprob is None else (logprob, top))
                reason = self._stoppers[req.request_id].append(token_id, terminated)
                if reason is not None:
                    break
            if s.prompt_logprobs is not None:
                upd.prompt_logprobs = s.prompt_logprobs
                req.prompt_logprobs_sent = True
            if reason is not None:
                self._finish(req, reason)
                upd.finish_reason = reason
            updates.append(upd)
        return updates

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if self.cache.holds(req.request_id) or req.num_computed:
            self._release.append(req.request_id)
        self.cache.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.error = reason, error
        del self.requests[req.request_id]
        self._stoppers.pop(req.request_id, None)


def _slice(req: Request, start: int, end: int) -> tuple[int, ...]:
    """Known token ids [start, end) without concatenating prompt and outputs (decode rows take one id)."""
    p = len(req.prompt_ids)
    if end <= p:
        return tuple(req.prompt_ids[start:end])
    if start >= p:
        return tuple(req.output_ids[start - p : end - p])
    return tuple(req.prompt_ids[start:]) + tuple(req.output_ids[: end - p])
