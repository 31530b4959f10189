"""ModelRunner: the only engine room that touches tensors.

It owns the memory: the cache pools, allocated once (`allocate`), which every sequence addresses by the slot and
blocks the CacheManager gave it (carried by the plan's rows). It turns a StepPlan into one ForwardBatch, runs the
pipeline's prefill or decode stage (by default the model's own step, models/step.py: the step metadata built on the
host, then `model.run(meta, pools)`; a decode step by CUDA-graph replay of `model.run` where it can), and samples
the rows that end at their sequence's last token. It executes plans strictly in order, which is what lets a plan
carry placeholder tokens (by the time a plan runs, the step before it has sampled them) and lets a freed slot or
block be handed to another request in the very next plan (the step still using it has finished by then).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.engine.backend import EngineBackend
from deepinfer.engine.grammars import sync_grammar
from deepinfer.engine.images import SpanRowCache, compute_rows
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
    # DSpark: the drafts made after the last sampled token (guesses for the tokens after it), the draft
    # distributions of a sampled request, and the confidence head's cumulative acceptance estimates
    drafts: list[int] = field(default_factory=list)
    draft_weights: list | None = None
    images: SpanRowCache | None = None  # the prompt's image spans while its prefill crosses them


class ModelRunner:
    def __init__(self, backend: EngineBackend, num_draft_tokens: int = 0, confidence_temperature=(1.0,)):
        from deepinfer.models import ForwardBatch  # here, not at import: importing the engine never loads the model code

        from deepinfer.sampling import SampleRow

        self._ForwardBatch = ForwardBatch
        self._SampleRow = SampleRow
        self.backend = backend
        self._seqs: dict[int, _Sequence] = {}
        self._masks = MaskBuilder()
        self.pools = None
        self.graphs = None
        self.draft_graphs = None
        self._graph_step = self._draft_graph_step = False
        self._rows_saved = 0  # YOCO compact: decoder-layer rows the last step did not compute
        self.padded_rows = 0  # padding tokens replayed so far: mixed-length verifications run as their longest
        # DSpark: drafts of up to num_draft tokens are made after every sampled token, when the model has draft layers
        drafter = getattr(backend.model, "drafter", None)
        self.drafter = drafter if num_draft_tokens > 0 else None
        self.num_draft = num_draft_tokens if self.drafter is not None else 0
        if self.drafter is not None:
            self.drafter.confidence_temperature = tuple(confidence_temperature)
        self._step_drafts = (0, 0)  # (verified, accepted) in the last step
        # Tests and benchmarks only: fn(sequence ids, prompt length, drafts) -> drafts, applied after the drafter ran
        # (a drafter that copies the target's known continuation, or one that is always wrong). None in serving.
        self.draft_override = None
        # Tests and benchmarks only: fn(sequence ids, prompt length, drafts) -> one confidence per draft, in place of
        # the drafter's (a confidence head that knows which drafts pass: what varlen's planner reads). None in serving.
        self.confidence_override = None
        # Benchmarks only: fn(sequence ids, prompt length, verified drafts) -> how many of them pass, in place of the
        # sampler's decision (made and paid as always): a controlled acceptance that holds whatever the numerics.
        # None in serving.
        self.accept_override = None
        # Lockstep (EngineCore.enter_lockstep: data-parallel ranks whose forwards are collectives): every execute
        # runs exactly one forward, and a step that fails raises instead of ending only its requests
        self.lockstep = False
        # Context parallel (EngineCore.enter_lockstep(cp)): a ContextParallel whose ranks run this same step; prefill
        # stages get cp= (each rank computes its mirror blocks; every rank's pools end up with the whole chunk),
        # decode stages run whole on every rank
        self.cp = None
        # Expert parallel with static dispatch buffers (the model's ExpertParallel): every forward of a step runs
        # under the path the ranks agreed for it first (`_ep_forward`), so that decode steps can replay graphs
        self._ep = None
        self.ep_pairing_forwards = 0  # extra static forwards beside another rank's graph warm-up

    def allocate(self, num_slots: int, num_blocks: int, block_size: int, max_model_len: int = 0,
                 graphs: bool = False, graph_interval: int = 8, max_rollback: int = 0,
                 checkpoint_slots: int = 0, checkpoint_lag: int = 0) -> None:
        """The cache pools for the whole run, sized by the CacheManager from the budget (`checkpoint_slots`:
        prefix caching's window checkpoints, slots after the sequences'); with `graphs` (CUDA, a model that can run
        from step metadata), decode steps of up to num_slots sequences replay CUDA graphs."""
        from deepinfer.models.cache import SequenceCache

        self._SequenceCache = SequenceCache
        extra = {"max_rollback": max_rollback} if max_rollback else {}
        if self.drafter is not None:
            extra["drafts"] = True
        if checkpoint_lag:
            extra["checkpoint_lag"] = checkpoint_lag
        self.pools = self.backend.allocate_cache(num_slots + checkpoint_slots, num_blocks, block_size, **extra)
        model = self.backend.model
        ep = getattr(model, "expert_parallel", None)
        if ep is not None and ep.buffers is not None:
            self._ep = ep
        elif ep is not None:
            graphs = False  # without static buffers every MoE layer reads its row counts on the host
        if graphs and self.pools.device.type == "cuda" and hasattr(model, "run"):
            self.graphs = self.decode_graphs(num_slots, graph_interval, max_model_len, block_size)
            if self.drafter is not None:
                from deepinfer.engine.cuda_graphs import DraftGraphs

                self.draft_graphs = DraftGraphs(self.drafter, self.pools, num_slots, graph_interval, self.num_draft,
                                                self.backend.vocab_size)

    def decode_graphs(self, num_slots: int, interval: int, max_model_len: int, block_size: int, cls=None):
        """The decode steps' graphs (deepinfer.engine.cuda_graphs.DecodeGraphs, or `cls` with its signature): batch
        buckets up to num_slots, block-table widths up to max_model_len, 1 + drafts tokens a sequence; under expert
        parallel only buckets within the static buffers, a failed warm-up raises (its collectives), and the static
        capacity of every step is rounded up to the same spacing in tokens (a graph bakes in the capacity it was
        captured with, so the ranks must agree one that a graph can have been captured for)."""
        from deepinfer.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes

        cls = cls or DecodeGraphs
        max_blocks = -(-max_model_len // block_size)
        ep_bound = None
        if self._ep is not None:
            ep_bound = self._ep.buffers.max_tokens
            self._ep.buffers.set_buckets(graph_batch_sizes(ep_bound, interval))
        return cls(self.backend.model, self.pools, num_slots, interval, max_blocks, 1 + self.num_draft,
                   max_tokens=ep_bound, collective=self._ep is not None)

    def profile_step(self, num_tokens: int) -> None:
        """One verification-shaped step of `num_tokens` tokens (sequences of 1 + num_draft tokens at position 0 in
        slots 0.., one block each), for the confidence scheduler's cost curve. Runs before any request: what it
        writes into the pools is never read (every sequence's reads are bounded by its own positions)."""
        per = self.num_draft + 1
        n = min(self.pools.num_slots, -(-num_tokens // per))
        lengths = [num_tokens // n + (i < num_tokens % n) for i in range(n)]
        states = [self._SequenceCache(self.pools, i, [i % self.pools.num_blocks]) for i in range(n)]
        batch = self._ForwardBatch([[0] * k for k in lengths], states, num_logits=list(lengths))
        self.backend.decode(batch) if all(k == 1 for k in lengths) else self.backend.prefill(batch)
        if self.pools.device.type == "cuda":
            torch.cuda.synchronize(self.pools.device)

    def dummy_step(self) -> None:
        """One forward without a sequence, for a rank that must join a step's collectives with nothing to run: one
        token at position 0 of the pools' spare slot and spare block, which no sequence reads (CUDA-graph padding
        rows write there too); its logits are dropped."""
        if self._ep is not None:
            self._ep_forward(1, None, None, self._dummy_forward)
        else:
            self._dummy_forward()

    def _dummy_forward(self) -> None:
        state = self._SequenceCache(self.pools, self.pools.spare_slot, [self.pools.spare_block])
        self.backend.decode(self._ForwardBatch([[0]], [state]))

    def _ep_forward(self, tokens: int, key, replay, eager):
        """One step's forward under expert parallel with static buffers: the ranks agree on the step first (one host
        all-reduce: the static path if every rank's step fits the buffers, the tokens its buffers are sized for (the
        largest rank's, rounded up to a graph bucket), and whether some rank captures a decode graph), then every
        forward of the step runs under that path, pinned. `key`: the decode graph that serves this step
        (DecodeGraphs.key_for) or None; `replay(key)`: its logits by replay of the graph of `key` with the agreed
        capacity (capturing first if needed) or None; `eager()`: the step run eagerly. A rank without a capture runs
        one extra static forward while a capturing rank runs its warm-up, so the collectives pair up
        (deepinfer.engine.cuda_graphs)."""
        ep, graphs = self._ep, self.graphs
        own = graphs.tokens(key) if key is not None else tokens
        # a graph bakes in its capacity, which the agreement decides: whether this rank would capture, per capacity
        needs = [key is not None and b >= own and graphs.needs_capture(graphs.sized(key, b))
                 for b in ep.buffers.buckets or ()]
        path = ep.agree_step(own, needs)
        sized = graphs.sized(key, path.tokens) if key is not None and path.static else None
        capture = sized is not None and graphs.needs_capture(sized)
        with ep.pin(path):
            if path.captures and not capture:
                self.ep_pairing_forwards += 1
                self._dummy_forward()
            out = replay(sized) if sized is not None else None
            return out if out is not None else eager()

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._seqs.pop(rid, None)

    def close(self) -> None:
        self._masks.close()

    def execute(self, plan: StepPlan) -> StepResult:
        self.release(plan.release)
        t0 = time.perf_counter()
        if not plan.rows:
            if self.lockstep:
                self.dummy_step()
            return StepResult(plan.step_id, [], t_start=t0, t_end=t0)
        self._graph_step, self._draft_graph_step, self._rows_saved = False, False, 0
        self._step_drafts = (0, 0)
        try:
            samples, prepare_s = self._run(plan, t0)
        except Exception as exc:  # a failed step ends its requests with an error instead of killing the engine
            if self.lockstep:
                raise  # the other ranks wait in this step's collectives: the run cannot continue
            self.release([row.request_id for row in plan.rows])  # their states may be half-advanced
            msg = f"model step failed: {type(exc).__name__}: {exc}"
            traceback.print_exc()
            return StepResult(plan.step_id, [], error=msg, t_start=t0, t_end=time.perf_counter())
        verified, accepted = self._step_drafts
        return StepResult(plan.step_id, samples, t_start=t0, t_end=time.perf_counter(), prepare_s=prepare_s,
                          graph=self._graph_step, draft_graph=self._draft_graph_step, num_draft_tokens=verified,
                          num_accepted_tokens=accepted, replay_rows_saved=self._rows_saved)

    def _run(self, plan: StepPlan, t0: float) -> tuple[list[SampledToken], float]:
        rows, token_lists, states, sampled, grammars = [], [], [], [], []
        drafts_of: dict[int, int] = {}  # id(sequence) -> drafts verified in this step
        for row in plan.rows:
            if row.new is not None:
                new = row.new
                state = self._SequenceCache(self.pools, row.slot, row.new_blocks)
                if new.restore_slot >= 0:  # a prefix-cache hit: the window at the cached boundary
                    self.pools.copy_slot(new.restore_slot, row.slot)
                state.num_tokens = new.num_cached
                seq = _Sequence(state, list(new.token_ids), new.num_prompt_tokens, new.params, new.seed)
                seq.penalized = _has_penalties(new.params)
                seq.prompt_rows = [] if new.prompt_logprobs else None
                seq.images = SpanRowCache(new.images) if new.images else None
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
            k = 0
            if row.num_drafts and row.sample:
                # room left under max_tokens: the anchor's token, then at most k accepted drafts + 1 more token
                room = seq.params.max_tokens - (len(seq.ids) - seq.num_prompt) - 1
                k = max(0, min(row.num_drafts, len(seq.drafts), room))
                ids += seq.drafts[:k]
            drafts_of[id(seq)] = k
            rows.append(row)
            token_lists.append(ids)
            states.append(seq.state)
            if row.sample:
                sampled.append(seq)
                grammars.append(row.grammar)
        by_seq: dict[int, SampledToken] = {}
        prepare_s = time.perf_counter() - t0
        if rows:
            images = self._span_rows(rows, token_lists)
            prepare_s = self._forward_and_sample(plan, rows, token_lists, states, sampled, grammars, by_seq, t0,
                                                 drafts_of, images)
        elif self.lockstep:
            self.dummy_step()  # every row was skipped: the step's collectives still need this rank
        lost = SampledToken(0, error="the request's state was lost in a failed step")
        samples = [by_seq.get(id(self._seqs.get(row.request_id)), lost) for row in plan.rows if row.sample]
        return samples, prepare_s

    def _span_rows(self, rows, token_lists) -> list | None:
        """Per row, the image-span rows among its new tokens (models.SpanRows), or None for a step without any. The
        ViT and aligner run here, once over every image that this step reaches first (engine/images.py)."""
        caches = [self._seqs[row.request_id].images for row in rows]
        if not any(caches):
            return None
        from deepinfer.models import SpanRows

        ranges = [(row.start, row.start + len(ids)) for row, ids in zip(rows, token_lists)]
        compute_rows(self.backend.model.vision,
                     [(c, c.missing(*r)) for c, r in zip(caches, ranges) if c is not None])
        out = []
        for c, r in zip(caches, ranges):
            got = c.take(*r) if c is not None else None
            out.append(SpanRows(*got) if got is not None else None)
        return out if any(x is not None for x in out) else None

    def _forward_and_sample(self, plan, rows, token_lists, states, sampled, grammars, by_seq, t0, drafts_of,
                            images=None) -> float:
        # Prompt logprobs need the logits of every prompt row, so such a step asks the model for all rows; a
        # verifying row needs the logits of its anchor and of each draft.
        all_logits = any(self._seqs[row.request_id].prompt_rows is not None for row in rows)
        num_logits = None
        if not all_logits and any(drafts_of.values()):
            num_logits = [drafts_of[id(self._seqs[row.request_id])] + 1 for row in rows]
        # which sequences feed generated tokens (not prompt tokens): only those may take the decode attention path,
        # whatever they are batched with, so a prompt row's attention never depends on how its prompt was chunked
        generated = [states[i].num_tokens >= self._seqs[row.request_id].num_prompt for i, row in enumerate(rows)]
        decode_only = all(len(ids) == 1 and g for ids, g in zip(token_lists, generated))
        replay, data_lens = self._replay(rows, token_lists, states)
        decode_only = decode_only and replay is None  # a one-token prompt chunk under replay is prefilled
        # the decode stage: every row one token, or an anchor + its drafts (a verification)
        decoding = replay is None and images is None and all(
            row.new is None and len(ids) == 1 + drafts_of.get(id(self._seqs[row.request_id]), 0)
            for row, ids in zip(rows, token_lists))
        stage = self.backend.decode if decoding else self.backend.prefill
        batch = self._ForwardBatch(token_ids=token_lists, states=states, all_logits=all_logits, replay=replay,
                                   data_lens=data_lens,
                                   decode_rows=generated if replay is None and self.cp is None else None,
                                   images=images)
        if num_logits is not None:
            batch.num_logits = num_logits
        # Sampler rows and grammar masks depend only on tokens sampled by earlier steps: build them before the
        # forward, the masks on a helper thread while the model runs. Verifying rows build theirs in the sampler
        # (a draft's row needs the grammar advanced through the drafts before it).
        sample_rows, row_errors, plain = [], [], []
        for i, (seq, grammar) in enumerate(zip(sampled, grammars)):
            error = _sync(seq, grammar)
            if error is not None:
                grammars[i] = None  # the row is still sampled (its batch needs it), then ends with the error
            row_errors.append(error)
            sample_rows.append(self._sample_row(seq, grammars[i]))
            if not drafts_of.get(id(seq)):
                plain.append(i)
        mask_job = self._masks.start([sample_rows[i] for i in plain], self.backend.vocab_size)
        prepare_s = time.perf_counter() - t0
        try:
            # decode steps, and verification steps whose sequences all bring the same number of drafts; one with
            # mixed numbers (varlen, or max_tokens near) as its longest, padded (DecodeGraphs.padded)
            same = all(generated) and len({len(t) for t in token_lists}) == 1
            key, graph_lists, pads = None, token_lists, None
            if self.graphs is not None and not all_logits and images is None and (
                    decode_only or num_logits is not None):
                if same:
                    key = self.graphs.key_for(token_lists, states)
                elif decoding and all(generated) and num_logits is not None:
                    graph_lists, pads, key = self.graphs.padded(token_lists, states)

            def replay(key):
                out = self.graphs.run(graph_lists, states, key)
                self._graph_step = out is not None
                if out is not None and pads is not None:
                    L = len(graph_lists[0])  # keep each sequence's real rows; forget its padding tokens
                    out = out[torch.tensor([i * L + j for i, n in enumerate(num_logits) for j in range(n)],
                                           device=out.device)]
                    for state, pad in zip(states, pads):
                        if pad:
                            state.rollback(pad)
                    self.padded_rows += sum(pads)
                return out

            # a partial, not a closure: no frame of its own between the step and the model
            eager = functools.partial(stage, batch) if self.cp is None or decoding else \
                functools.partial(stage, batch, cp=self.cp)

            if self._ep is not None:
                logits = self._ep_forward(sum(len(t) for t in token_lists), key, replay, eager)
            else:
                logits = replay(key) if key is not None else None
                if logits is None:
                    logits = eager()
            for src, dst in plan.snapshots:  # prefix caching: windows at a checkpoint boundary, before drafting
                self.pools.copy_slot(src, dst)
        finally:
            mask = mask_job.result() if mask_job is not None else None  # never leave a fill running on a state
        prompt_lps = {}
        if all_logits:
            logits, prompt_lps = self._collect_prompt_rows(rows, token_lists, logits)
        if not sampled:
            return prepare_s
        # the logits rows of each sampled sequence (1, or 1 + drafts)
        counts = num_logits or [1] * len(rows)
        offsets, acc = [], 0
        for n in counts:
            offsets.append(acc)
            acc += n
        seq_rows = {id(self._seqs[row.request_id]): (off, n) for row, off, n in zip(rows, offsets, counts)}
        verify = sorted(set(range(len(sampled))) - set(plain))
        if plain:
            idx = [seq_rows[id(sampled[i])][0] + seq_rows[id(sampled[i])][1] - 1 for i in plain]
            sub = logits if idx == list(range(logits.shape[0])) else logits[idx]
            if mask is not None and mask.shape[1] * 32 < sub.shape[1]:
                mask = None  # a stage whose logits are wider than the model's vocab_size: let the sampler rebuild it
            outs = self.backend.sampler.sample(sub, [sample_rows[i] for i in plain], token_bitmask=mask)
            for i, out in zip(plain, outs):
                seq, grammar = sampled[i], grammars[i]
                seq.ids.append(out.token_id)
                ended = grammar is not None and grammar.is_terminated()
                error = row_errors[i] or getattr(out, "error", None)
                by_seq[id(seq)] = SampledToken(out.token_id, out.logprob, out.top_logprobs, error,
                                               prompt_lps.get(id(seq)), ended)
        if verify:
            self._verify(verify, sampled, grammars, sample_rows, row_errors, seq_rows, drafts_of, logits,
                         prompt_lps, by_seq)
        if self.drafter is not None:
            self._draft(sampled, by_seq)
        return prepare_s

    def _verify(self, verify, sampled, grammars, sample_rows, row_errors, seq_rows, drafts_of, logits, prompt_lps,
                by_seq) -> None:
        """DSpark: the sampler accepts each verifying sequence's drafts against its anchor + draft rows; the
        sequence keeps the accepted drafts and the token after them, and rolls back the rejected ones."""
        from deepinfer.sampling import VerifyRequest

        reqs, idx = [], []
        for i in verify:
            seq = sampled[i]
            k = drafts_of[id(seq)]
            off, n = seq_rows[id(seq)]
            idx += range(off, off + n)
            weights = seq.draft_weights[:k] if seq.draft_weights is not None else None
            reqs.append(VerifyRequest(sample_rows[i], seq.drafts[:k], weights))
        verified = accepted = 0
        for i, outs in zip(verify, self.backend.sampler.verify(logits[idx], reqs)):
            seq, grammar = sampled[i], grammars[i]
            if self.accept_override is not None:
                k = drafts_of[id(seq)]
                outs = _rigged(outs, seq.drafts[:k], self.accept_override(seq.ids, seq.num_prompt, seq.drafts[:k]),
                               self.backend.vocab_size)
            k, m = drafts_of[id(seq)], len(outs) - 1
            seq.ids.extend(o.token_id for o in outs)
            seq.state.rollback(k - m)  # the rejected drafts' cache entries are overwritten later
            verified, accepted = verified + k, accepted + m
            last = outs[-1]
            ended = grammar is not None and grammar.is_terminated()
            error = row_errors[i] or getattr(last, "error", None)
            by_seq[id(seq)] = SampledToken(
                last.token_id, last.logprob, last.top_logprobs, error, prompt_lps.get(id(seq)), ended,
                accepted=tuple((o.token_id, o.logprob, o.top_logprobs) for o in outs[:-1]), num_draft_tokens=k)
        self._step_drafts = (verified, accepted)

    def _draft(self, sampled: list[_Sequence], by_seq: dict) -> None:
        """DSpark: drafts for every sequence that just got a token (verified next step), in one batch."""
        from deepinfer.sampling.speculative import DraftChooser, DraftRequest

        seqs = [seq for seq in sampled if by_seq[id(seq)].error is None]
        if not seqs:
            return
        dev = self.pools.device
        slots = [seq.state.slot for seq in seqs]
        last = [seq.state.num_tokens - 1 for seq in seqs]
        golden = [seq.ids[-1] for seq in seqs]
        chooser = DraftChooser([DraftRequest(seq.params, seq.seed, len(seq.ids) - seq.num_prompt) for seq in seqs],
                               self.backend.vocab_size)
        out = None
        if self.draft_graphs is not None:
            out = self.draft_graphs.run(golden, slots, last, chooser)
            self._draft_graph_step = out is not None
        if out is None:
            as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
            step = self.drafter.step(as_tensor(slots), as_tensor(last), self.num_draft, self.pools)
            drafted = self.drafter.draft(as_tensor(golden), step, self.pools, chooser)
            out = drafted.tokens, drafted.confidences
        # the drafts and their running confidences in one host read (float64 holds both exactly): each read is a
        # synchronisation that leaves the device idle
        n = out[0].shape[1]
        both = torch.cat([out[0].double(), torch.cumprod(out[1], 1).double()], 1).tolist()
        tokens, rates = [[int(t) for t in row[:n]] for row in both], [row[n:] for row in both]
        for r, seq in enumerate(seqs):
            seq.drafts = tokens[r]
            seq.draft_weights = None if seq.params.greedy else chooser.weights[r]
            if self.draft_override is not None:
                seq.drafts = list(self.draft_override(seq.ids, seq.num_prompt, tokens[r]))
                seq.draft_weights = None  # point masses: verification stays exact for any fixed drafts
            if self.confidence_override is not None:
                # running products in Python floats (float64, in order: torch.cumprod's values), not three torch
                # calls a row: a benchmark's hook, its host time inside the step it measures
                conf = self.confidence_override(seq.ids, seq.num_prompt, seq.drafts)
                rates[r] = list(itertools.accumulate(map(float, conf), operator.mul))
            tok = by_seq[id(seq)]
            by_seq[id(seq)] = dataclasses.replace(tok, rates=tuple(rates[r]))

    def _replay(self, rows, token_lists, states):
        """The pipeline's replay stage (YOCO) and each sequence's full known length, for a step in which it cuts
        some row's window (a prefill chunk before the last K rows of its sequence); else (None, None): decode and
        verification rows are never cut (K >= window + max backtracking)."""
        replay = self.backend.replay
        if replay is None:
            return None, None
        known = [max(len(self._seqs[row.request_id].ids), st.num_tokens + len(ids))
                 for row, ids, st in zip(rows, token_lists, states)]
        lengths, pasts = [len(ids) for ids in token_lists], [st.num_tokens for st in states]
        if not replay.applies(lengths, pasts, known):
            return None, None
        self._rows_saved = replay.rows_saved(lengths, pasts, known)
        return replay, known

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


def _rigged(outs: list, drafts: list[int], passing: int, vocab: int) -> list:
    """accept_override's verification: the sampler's outputs (one per appended token) rewritten as if exactly
    min(passing, k) of the k drafts passed: those drafts, then one more token (a correction that differs from the
    next draft, or the bonus token after all k)."""
    n = max(0, min(int(passing), len(drafts)))
    like = lambda i, t: dataclasses.replace(outs[min(i, len(outs) - 1)], token_id=t)  # noqa: E731
    last = outs[min(n, len(outs) - 1)].token_id
    if n < len(drafts) and last == drafts[n]:
        last = (last + 1) % vocab
    return [like(i, t) for i, t in enumerate(drafts[:n])] + [like(n, last)]
