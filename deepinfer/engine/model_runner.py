"""ModelRunner: the only engine room that touches tensors.

It owns the memory: the cache pools, allocated once (`allocate`), which every sequence addresses by the slot and
blocks the CacheManager gave it (carried by the plan's rows). It turns a StepPlan into one ForwardBatch, runs the
pipeline's prefill or decode stage (a decode step by CUDA-graph replay where it can), and samples the rows that end
at their sequence's last token. It executes plans strictly in order, which is what lets a plan carry placeholder
tokens (by the time a plan runs, the step before it has sampled them) and lets a freed slot or block be handed to
another request in the very next plan (the step still using it has finished by then).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.engine.backend import EngineBackend
from deepinfer.engine.grammars import sync_grammar
from deepinfer.engine.masks import MaskBuilder
from deepinfer.engine.plan import SampledToken, StepPlan, StepResult


@dataclass
class _Sequence:
    state: Any
    ids: list[int]  # every token of the sequence the runner knows, sampled ones included
    num_prompt: int
    params: Any
    seed: int
    penalized: bool = field(default=False)
    prompt_rows: list | None = None  # logits rows over the prompt, while prompt logprobs are being collected


class ModelRunner:
    def __init__(self, backend: EngineBackend):
        from deepinfer.models import ForwardBatch  # here, not at import: importing the engine never loads the model code

        from deepinfer.sampling import SampleRow

        self._ForwardBatch = ForwardBatch
        self._SampleRow = SampleRow
        self.backend = backend
        self._seqs: dict[int, _Sequence] = {}
        self._masks = MaskBuilder()
        self.pools = None
        self.graphs = None
        self._graph_step = False

    def allocate(self, num_slots: int, num_blocks: int, block_size: int, max_model_len: int = 0,
                 graphs: bool = False, graph_interval: int = 8) -> None:
        """The cache pools for the whole run, sized by the CacheManager from the budget; with `graphs` (CUDA, a
        model that can run from step metadata), decode steps of up to num_slots sequences replay CUDA graphs."""
        from deepinfer.models.cache import SequenceCache

        self._SequenceCache = SequenceCache
        self.pools = self.backend.allocate_cache(num_slots, num_blocks, block_size)
        model = self.backend.model
        if graphs and self.pools.device.type == "cuda" and hasattr(model, "run"):
            from deepinfer.engine.cuda_graphs import DecodeGraphs

            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(model, self.pools, num_slots, graph_interval, max_blocks)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def state_of(self, request_id: int):
        return self._seqs[request_id].state

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._seqs.pop(rid, None)

    def close(self) -> None:
        self._masks.close()

    def execute(self, plan: StepPlan) -> StepResult:
        self.release(plan.release)
        t0 = time.perf_counter()
        if not plan.rows:
            return StepResult(plan.step_id, [], t_start=t0, t_end=t0)
        self._graph_step = False
        try:
            samples, prepare_s = self._run(plan, t0)
        except Exception as exc:  # a failed step ends its requests with an error instead of killing the engine
            self.release([row.request_id for row in plan.rows])  # their states may be half-advanced
            msg = f"model step failed: {type(exc).__name__}: {exc}"
            traceback.print_exc()
            return StepResult(plan.step_id, [], error=msg, t_start=t0, t_end=time.perf_counter())
        return StepResult(plan.step_id, samples, t_start=t0, t_end=time.perf_counter(), prepare_s=prepare_s,
                          graph=self._graph_step)

    def _run(self, plan: StepPlan, t0: float) -> tuple[list[SampledToken], float]:
        rows, token_lists, states, sampled, grammars = [], [], [], [], []
        for row in plan.rows:
            if row.new is not None:
                new = row.new
                state = self._SequenceCache(self.pools, row.slot, row.new_blocks)
                seq = _Sequence(state, list(new.token_ids), new.num_prompt_tokens, new.params, new.seed)
                seq.penalized = _has_penalties(new.params)
                seq.prompt_rows = [] if new.prompt_logprobs else None
                self._seqs[row.request_id] = seq
            elif row.request_id not in self._seqs:
                # Its state was dropped by a failed earlier step (the request has already ended with that error);
                # this plan was made before the failure was known. Skip the row instead of failing the batch.
                continue
            seq = self._seqs[row.request_id]
            if row.new is None and row.new_blocks:
                seq.state.blocks.extend(row.new_blocks)
            ids = list(row.token_ids)
            if row.placeholder:
                ids.append(seq.ids[-1])  # sampled by the previous step, which has finished by now
            rows.append(row)
            token_lists.append(ids)
            states.append(seq.state)
            if row.sample:
                sampled.append(seq)
                grammars.append(row.grammar)
        by_seq: dict[int, SampledToken] = {}
        prepare_s = time.perf_counter() - t0
        if rows:
            prepare_s = self._forward_and_sample(plan, rows, token_lists, states, sampled, grammars, by_seq, t0)
        lost = SampledToken(0, error="the request's state was lost in a failed step")
        samples = [by_seq.get(id(self._seqs.get(row.request_id)), lost) for row in plan.rows if row.sample]
        return samples, prepare_s

    def _forward_and_sample(self, plan, rows, token_lists, states, sampled, grammars, by_seq, t0) -> float:
        # Prompt logprobs need the logits of every prompt row, so such a step asks the model for all rows.
        all_logits = any(self._seqs[row.request_id].prompt_rows is not None for row in rows)
        decode_only = all(len(ids) == 1 and row.new is None for row, ids in zip(rows, token_lists))
        stage = self.backend.decode if decode_only else self.backend.prefill
        batch = self._ForwardBatch(token_ids=token_lists, states=states, all_logits=all_logits)
        # Sampler rows and grammar masks depend only on tokens sampled by earlier steps: build them before the
        # forward, the masks on a helper thread while the model runs.
        sample_rows, row_errors = [], []
        for i, (seq, grammar) in enumerate(zip(sampled, grammars)):
            error = _sync(seq, grammar)
            if error is not None:
                grammars[i] = None  # the row is still sampled (its batch needs it), then ends with the error
            row_errors.append(error)
            sample_rows.append(self._sample_row(seq, grammars[i]))
        mask_job = self._masks.start(sample_rows, self.backend.vocab_size)
        prepare_s = time.perf_counter() - t0
        try:
            logits = None
            if self.graphs is not None and decode_only and not all_logits:
                logits = self.graphs.run(token_lists, states)
                self._graph_step = logits is not None
            if logits is None:
                logits = stage(batch)
        finally:
            mask = mask_job.result() if mask_job is not None else None  # never leave a fill running on a state
        prompt_lps = {}
        if all_logits:
            logits, prompt_lps = self._collect_prompt_rows(rows, token_lists, logits)
        if not sampled:
            return prepare_s
        if len(sampled) != len(rows):
            logits = logits[[i for i, row in enumerate(rows) if row.sample]]
        if mask is not None and mask.shape[1] * 32 < logits.shape[1]:
            mask = None  # a stage whose logits are wider than the model's vocab_size: let the sampler rebuild it
        outs = self.backend.sampler.sample(logits, sample_rows, token_bitmask=mask)
        for seq, out, grammar, row_error in zip(sampled, outs, grammars, row_errors):
            seq.ids.append(out.token_id)
            lps = prompt_lps.get(id(seq))
            ended = grammar is not None and grammar.is_terminated()
            error = row_error or getattr(out, "error", None)
            by_seq[id(seq)] = SampledToken(out.token_id, out.logprob, out.top_logprobs, error, lps, ended)
        return prepare_s

    def _collect_prompt_rows(self, rows, token_lists, logits):
        """Keeps each collecting sequence's prompt rows; returns the last-row logits per sequence and the finished
        prompt logprobs (keyed by id(sequence)) of sequences whose prompt ends in this step."""
        from deepinfer.sampling import prompt_logprobs

        last, done, offset = [], {}, 0
        for row, ids in zip(rows, token_lists):
            n = len(ids)
            last.append(offset + n - 1)
            seq = self._seqs[row.request_id]
            if seq.prompt_rows is not None:
                keep = max(0, min(n, seq.num_prompt - 1 - row.start))  # row i predicts prompt token i + 1
                if keep:
                    seq.prompt_rows.append(logits[offset : offset + keep].clone())
                if row.start + n >= seq.num_prompt:
                    rows = seq.prompt_rows
                    full = torch.cat(rows) if rows else logits[:0]
                    prompt = seq.ids[: seq.num_prompt]
                    top = getattr(seq.params, "top_logprobs", 0)
                    done[id(seq)] = prompt_logprobs(full, prompt, top, self.backend.sampler.vocab_size)
                    seq.prompt_rows = None
            offset += n
        return logits[last], done

    def _sample_row(self, seq: _Sequence, grammar=None):
        position = len(seq.ids) - seq.num_prompt
        if seq.penalized:  # the history lists cost a copy per step: only penalties read them
            return self._SampleRow(
                seq.params, seq.seed, position, seq.ids[seq.num_prompt :], seq.ids[: seq.num_prompt], grammar
            )
        return self._SampleRow(seq.params, seq.seed, position, grammar_state=grammar)


def _sync(seq: _Sequence, grammar) -> str | None:
    """Brings the grammar to the sequence's output before it is sampled again; the error if it cannot.

    Differs after a recompute (the matcher accepted a token that the preemption dropped: roll back) and after a
    row that ended in an error (its token went into the sequence, not into the matcher); with async scheduling
    such a request can still have one row planned, whose result is dropped: it must not fail its whole step."""
    if grammar is None or grammar.num_accepted == len(seq.ids) - seq.num_prompt:
        return None
    return sync_grammar(grammar, seq.ids[seq.num_prompt :])


def _has_penalties(params: Any) -> bool:
    return (
        getattr(params, "repetition_penalty", 1.0) != 1.0
        or getattr(params, "frequency_penalty", 0.0) != 0.0
        or getattr(params, "presence_penalty", 0.0) != 0.0
    )
