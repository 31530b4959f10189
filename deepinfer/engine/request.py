"""One request as the engine core sees it: token ids, sampling params and progress counters.

Pure Python. The counters are what the scheduler plans with:

    all tokens   = prompt_ids + output_ids (known on the CPU) + num_pending (sampled by an in-flight step,
                   not yet back: async scheduling's placeholders)
    num_computed = tokens whose cache entries the model state holds, counting steps already launched
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    params: Any  # SamplingParams, read duck-typed: max_tokens, min_tokens, ignore_eos, stop_token_ids
    seed: int  # per-request sampling seed, fixed at arrival so a recompute after preemption draws the same
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    num_pending: int = 0
    # Bumped on every preemption: results of steps launched before it belong to a dropped state.
    epoch: int = 0
    num_preemptions: int = 0
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None
    error: str | None = None
    # Structured outputs: True while the grammar compiles (the request may prefill but is not sampled), then the
    # GrammarState, kept across preemptions (the runner rolls it back to the output on recompute).
    grammar_pending: bool = False
    grammar_state: Any = None
    # DSpark: drafts planned in rows not folded in yet (their accepted tokens will also be in the cache), the
    # confidence head's cumulative acceptance estimates of the newest drafts and of the ones before, and totals
    draft_slack: int = 0
    rates: list = field(default_factory=list)
    prev_rates: list = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # the prompt's images, decoded on arrival (engine/images.py PromptImage), kept for a recompute after preemption
    images: list = field(default_factory=list)
    # queue time: from arrival in the core to the first admission (perf_counter); reported once, with the first
    # update (RequestUpdate.queued_s)
    arrival: float = field(default_factory=time.perf_counter)
    queued_s: float | None = None
    queue_time_sent: bool = False
    # Prefix caching: the chain hash of each full block of known tokens computed so far (engine/prefix_cache.py),
    # the root they chain from (the cache salt), the prompt tokens the first admission found cached (reported)
    cache_salt: str | None = None  # only requests with the same salt (or none) share cached prefixes
    block_hashes: list = field(default_factory=list)
    hash_root: bytes = b""
    num_cached_tokens: int = 0
    branch_point: int = 0  # where its prompt leaves the cached blocks found at admission: checkpointed too

    @property
    def may_sample(self) -> bool:
        return not self.grammar_pending

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def num_known(self) -> int:
        """Tokens whose ids the CPU holds."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence including placeholders for samples still in flight."""
        return self.num_known + self.num_pending

    @property
    def num_generated(self) -> int:
        """Generated tokens counting in-flight samples: what max_tokens is checked against when planning."""
        return len(self.output_ids) + self.num_pending

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
