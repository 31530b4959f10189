"""What crosses between the scheduler and the model runner: a step's plan and the step's result.

A plan is built on the CPU; with async scheduling it is built while the previous step still runs, so a decode row
may not know its input token yet (`placeholder`): the runner fills it in with the token the previous step sampled
for that request, which by then has been produced (the runner executes steps strictly in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NewSequence:
    """Sent with a request's first row after (re)admission: everything the runner needs to build its state."""

    token_ids: tuple[int, ...]  # all known ids: prompt + outputs generated before a preemption
    num_prompt_tokens: int
    params: Any
    seed: int
    prompt_logprobs: bool = False  # collect logits over the prompt (not again after a preemption delivered them)
    # prefix caching: the sequence starts with num_cached tokens (its first row's `start`), held by the shared
    # blocks at the head of the row's new_blocks and by the window checkpoint in slot `restore_slot`, which the
    # runner copies into the sequence's slot before the step (-1: nothing cached)
    num_cached: int = 0
    restore_slot: int = -1
    images: tuple = ()  # the prompt's images (engine/images.py PromptImage): the ViT runs when a step reaches them


@dataclass(frozen=True)
class ScheduledRow:
    request_id: int
    epoch: int
    start: int  # position of the first new token in the sequence
    token_ids: tuple[int, ...]  # new tokens known on the CPU
    placeholder: bool  # one more new token follows: the one the in-flight step samples for this request
    sample: bool  # the logits after the last new token give this request's next token
    new: NewSequence | None = None
    slot: int = -1  # the request's slot in the cache pools (CacheManager)
    new_blocks: tuple[int, ...] = ()  # blocks reserved since its previous row (all of them with `new`)
    # On sampling rows of a request with so_args: its GrammarState (ready; the scheduler plans no sampling row
    # before it is). Lives in the engine core, so it never crosses a process boundary.
    grammar: Any = None
    # DSpark: at most this many of the request's drafts follow its anchor token and are verified in this step (the
    # runner holds the drafts, made after the step that sampled the anchor; it verifies fewer when it has fewer or
    # when max_tokens leaves less room). The accepted ones come back with the sample.
    num_drafts: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + int(self.placeholder) + self.num_drafts


@dataclass
class StepPlan:
    step_id: int
    rows: list[ScheduledRow]
    # States the runner drops before this step: finished or preempted since the previous plan.
    release: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    # prefix caching: (sequence slot, checkpoint slot) copies the runner makes right after this step's forward
    # (each sequence then holds exactly a checkpoint boundary's tokens); the block and checkpoint hashes this step
    # fills, matched only once its result is in; the tokens its admissions looked up and found cached
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    named_blocks: list[tuple[int, bytes]] = field(default_factory=list)  # (request id, block hash)
    named_checkpoints: list[tuple[int, bytes]] = field(default_factory=list)  # (request id, boundary hash)
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: Any = None
    error: str | None = None  # this row could not be sampled: its request ends with the message
    prompt_logprobs: list | None = None  # with the first token: SampleOutput | None per prompt token
    # The request's grammar ended with this token, read right after sampling: with async scheduling the next
    # step may already be advancing the same GrammarState by the time the core folds this token in.
    grammar_terminated: bool = False
    # DSpark: the drafts accepted before token_id, each (token_id, logprob, top_logprobs); how many drafts were
    # verified; the cumulative acceptance estimates (confidence head) of the drafts made for the next step.
    accepted: tuple = ()
    num_draft_tokens: int = 0
    rates: tuple = ()


@dataclass
class StepResult:
    step_id: int
    # One entry per row of the plan with sample=True, in row order.
    samples: list[SampledToken]
    error: str | None = None  # the step failed: every request in it ends with this message
    t_start: float = 0.0  # device-side timing (perf_counter) of forward + sample
    t_end: float = 0.0
    prepare_s: float = 0.0  # of which Python bookkeeping in the runner: batch inputs and sampler rows
    graph: bool = False  # the forward replayed a captured CUDA graph
    draft_graph: bool = False  # DSpark drafting replayed a captured CUDA graph
    num_draft_tokens: int = 0  # DSpark drafts verified in this step, and how many of them were accepted
    num_accepted_tokens: int = 0
    replay_rows_saved: int = 0  # YOCO compact: decoder-layer rows (rows x consumer layers) not computed
