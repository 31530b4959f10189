"""The sample stage: one call per engine step turns the batch's last-position logits into one token per row.

Pipeline, in this order, per row (``Sampler.sample``):
  0. logprobs      log_softmax of the raw logits, kept for reporting (chosen token + top_logprobs alternatives)
  1. blacklist     vocab padding columns; EOS and stop_token_ids while fewer than min_tokens tokens exist
                   (EOS is not blacklisted when ignore_eos, since it then ends nothing)
  2. grammar mask  the structured-output bitmask of the row's GrammarState (built on the CPU; the engine may
                   build it while the model runs and pass it in)
  3. penalties     repetition (prompt + output tokens, multiplicative), then frequency and presence (output only),
                   then logit_bias (added to the listed tokens' logits)
  4. greedy        rows with temperature < 1e-5 take the argmax here (ties: lowest id) and skip the rest
  5. temperature   logits / temperature
  6. top-k         the k most likely (stable sort: ties keep the lowest ids)
  7. top-p         the smallest most-likely-first prefix reaching mass top_p, measured after top-k
  8. min-p         drop tokens with p < min_p * p_max
  9. draw          inverse CDF: the token whose interval of the exact integer CDF (``fixed_point``) holds
                   u * total, u a uniform that is a pure function of (seq_seed, position, draw kind)
 10. grammar       the drawn token is accepted by the row's GrammarState (the matcher advances)

Why counter-based uniforms: a draw then reads nothing but its own row and its own seed, so a request samples the
same tokens whatever it is batched with, and no generator state needs saving or restoring.

Batch invariance of the draw holds in every mode, by construction: each step is element-wise, or an exact
operation (max, argmax with first-index ties, stable sort, searchsorted, integer counts), or an integer sum
(top-p's mass and the draw's CDF). No float reduction whose schedule could follow the batch shape decides a token.
``batch_invariant=True`` extends that to the reported logprobs (an integer normaliser instead of log_softmax's
float reduction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.sampling import processors as proc
from deepinfer.sampling.bitmask import allocate_bitmask, apply_bitmask_
from deepinfer.sampling.fixed_point import draw_tokens
from deepinfer.sampling.logprobs import SampleOutput, raw_logprobs, top_n
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.queued_copy import queued_values
from deepinfer.sampling.row_columns import processed_weights
from deepinfer.sampling.seeds import DrawKind, uniform
from deepinfer.sampling.wide_reduce import first_argmax, row_max

__all__ = ["Sampler", "SampleRow", "SampleOutput", "VerifyRequest"]


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of the batch.

    seed: the request's resolved uint64 seed (``seeds.request_seed`` / ``seeds.child_seed``).
    position: index of the token being drawn in the request's output, 0-based (== len(output_ids) normally).
    grammar_state: the request's ``GrammarState`` when it has so_args, else None.
    """

    params: SamplingParams
    seed: int
    position: int
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    grammar_state: Any = None


@dataclass
class VerifyRequest:
    """One request's speculative verification: `row` describes its first target row (the position of the token
    after the anchor), `drafts` the k drafts, `draft_weights` the k draft distributions (sampled requests)."""

    row: SampleRow
    drafts: list[int]
    draft_weights: list | None = None


class Sampler:
    """Samples one token per row. vocab_size: the tokenizer's real vocabulary (logits may carry padding columns
    beyond it, which are never drawn). eos_token_id: suppressed before min_tokens. tokenizer: kept for
    ``stop_checker``. batch_invariant: also make the reported logprobs bitwise independent of the batch (the
    drawn tokens always are). grammar: the ``GrammarCompilerPool`` requests submit their so_args to (None:
    structured outputs off)."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_id: int | None,
        tokenizer=None,
        batch_invariant: bool = False,
        grammar=None,
    ):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = tokenizer
        self.batch_invariant = batch_invariant
        self.grammar = grammar

    # ---- what the engine calls ------------------------------------------------------------------------------

    def build_bitmask(self, rows: list[SampleRow], vocab_size: int | None = None) -> torch.Tensor | None:
        """The CPU int32 grammar bitmask for the rows (None when no row has a grammar). Cheap to call while
        the model runs; pass the result to ``sample`` as token_bitmask. vocab_size: the logits' width."""
        if all(row.grammar_state is None for row in rows):
            return None
        bitmask = allocate_bitmask(len(rows), vocab_size or self.vocab_size)
        for r, row in enumerate(rows):
            if row.grammar_state is not None:
                row.grammar_state.fill_bitmask(bitmask, r)
        return bitmask

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow], token_bitmask: torch.Tensor | None = None
    ) -> list[SampleOutput]:
        """logits: float32 [len(rows), vocab] on any device. Returns one SampleOutput per row, in row order,
        and advances each row's grammar state by its drawn token."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        if token_bitmask is None:
            token_bitmask = self.build_bitmask(rows, logits.shape[1])
        outputs = self._sample_rows(logits, rows, token_bitmask)
        self._advance_grammars(rows, outputs)
        return outputs

    def verify(self, logits: torch.Tensor, requests: list["VerifyRequest"]) -> list[list[SampleOutput]]:
        """Speculative verification (deepinfer.sampling.speculative): logits float32 [sum(k_i + 1), vocab], the
        k_i + 1 rows of each request in order. Returns per request the SampleOutputs of the tokens it appends
        (accepted drafts, then the target's token), and leaves its grammar state advanced by exactly those."""
        from deepinfer.sampling import speculative as spec

        rows, spans = [], []
        for req in requests:
            base, k = req.row, len(req.drafts)
            spans.append((len(rows), k))
            for j in range(k + 1):
                out_ids = base.output_ids + req.drafts[:j] if base.output_ids or base.prompt_ids else []
                rows.append(SampleRow(base.params, base.seed, base.position + j, out_ids, base.prompt_ids))
        if logits.shape[0] != len(rows):
            raise ValueError(f"verify: logits have {logits.shape[0]} rows; the requests need {len(rows)}")
        vocab = min(self.vocab_size, logits.shape[1])
        bitmask, advanced = None, [0] * len(requests)
        if any(req.row.grammar_state is not None for req in requests):
            bitmask = allocate_bitmask(len(rows), logits.shape[1])
            for i, (req, (start, k)) in enumerate(zip(requests, spans)):
                state = req.row.grammar_state
                if state is None:
                    continue
                for j in range(k + 1):  # row j's mask: the grammar after drafts 1..j (as far as it accepts them)
                    state.fill_bitmask(bitmask, start + j)
                    d = req.drafts[j] if j < k else -1
                    allowed = 0 <= d < bitmask.shape[1] * 32 and (int(bitmask[start + j, d >> 5]) >> (d & 31)) & 1
                    if not allowed or not state.accept_token(d):  # masked drafts are rejected in any case
                        break
                    advanced[i] += 1
        logprobs, x = self._logprobs_and_masked(logits, rows, bitmask, vocab)
        # one whole-step read instead of per-request ones: every row's argmax (greedy rows choose it; an accepted
        # greedy draft equals it), why no token can be chosen (if none can) and the argmax's logprob. With every
        # request greedy and no top logprobs asked, every token a verdict keeps is its row's argmax, so that read
        # also brings every logprob reported
        fast = all(req.row.params.greedy and not req.row.params.top_logprobs for req in requests)
        greedy_target, codes, row_lps = greedy_reads(logprobs, x, vocab)
        blocked = [BLOCKED[c] for c in codes]
        verdicts = [spec.accept_greedy_ids(greedy_target[start : start + k + 1], req.drafts)
                    if req.row.params.greedy else None for req, (start, k) in zip(requests, spans)]
        sampled = [i for i, v in enumerate(verdicts) if v is None]
        if sampled:  # every sampled request's rows in one batch (row-local transforms: the same weights)
            rows_of = [range(spans[i][0], spans[i][0] + spans[i][1] + 1) for i in sampled]
            at = queued_values([r for rs in rows_of for r in rs], torch.int64, x.device)
            p, _ = processed_weights(x.index_select(0, at), [requests[i].row.params for i, rs in zip(sampled, rows_of)
                                                             for _ in rs], vocab)
            batch = [spec.SampledDrafts(requests[i].drafts, requests[i].draft_weights, requests[i].row.seed,
                                        requests[i].row.position) for i in sampled]
            for i, v in zip(sampled, spec.accept_sampled_rows(p, batch)):
                verdicts[i] = v
        chosen = [start + r for (start, _), v in zip(spans, verdicts) for r in v.rows]
        tokens = [t for v in verdicts for t in v.tokens]
        if fast:  # each kept token is its row's argmax (accept_greedy_ids): its logprob came with the read
            lps, tops = [row_lps[r] for r in chosen], [None] * len(chosen)
        else:
            kept = logprobs.index_select(0, queued_values(chosen, torch.int64, x.device))
            ids = queued_values(tokens, torch.int64, x.device).clamp(max=vocab - 1)
            lps = kept.gather(1, ids[:, None]).squeeze(1).tolist()
            tops = top_n(kept, [requests[i].row.params.top_logprobs for i, v in enumerate(verdicts)
                                            for _ in v.rows])
        results, at = [], 0
        for i, (req, v) in enumerate(zip(requests, verdicts)):
            n = len(v.tokens)
            outs = [SampleOutput(t, lp, top) for t, lp, top in zip(v.tokens, lps[at : at + n], tops[at : at + n])]
            if blocked[chosen[at + n - 1]]:
                outs[-1].error = blocked[chosen[at + n - 1]]
            at += n
            state = req.row.grammar_state
            if state is not None:
                state.rollback(advanced[i] - v.num_accepted)
                if outs[-1].error is None and not state.accept_token(v.tokens[-1]):
                    outs[-1].error = f"the grammar rejected token {v.tokens[-1]}"
            results.append(outs)
        return results

    def stop_checker(self, params: SamplingParams):
        """A fresh StopChecker for one request (needs the tokenizer given at construction)."""
        from deepinfer.sampling.stop import StopChecker

        return StopChecker(params, self.tokenizer, self.eos_token_id)

    # ---- the pipeline ---------------------------------------------------------------------------------------

    def _sample_rows(
        self, logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None
    ) -> list[SampleOutput]:
        """Every row's token, why none could be chosen (if so) and its raw logprob come to the host in one read;
        everything before it is queued on the device (row_columns says why that matters)."""
        vocab = min(self.vocab_size, logits.shape[1])
        logprobs, x = self._logprobs_and_masked(logits, rows, bitmask, vocab)
        tokens = first_argmax(x)  # greedy rows: ties go to the lowest token id
        sampled = [r for r, row in enumerate(rows) if not row.params.greedy]
        if sampled:
            at = queued_values(sampled, torch.int64, x.device)
            w, cols = processed_weights(
                x.index_select(0, at), [rows[r].params for r in sampled], vocab,
                [[uniform(rows[r].seed, rows[r].position, DrawKind.TOKEN)] for r in sampled])
            tokens.index_copy_(0, at, draw_tokens(w, cols.uniforms[:, 0]))
        forced = self._golden_(rows, vocab)
        if forced:  # the forced ids, clamped only where they pick a logprob (an out-of-range one is an error)
            at = queued_values(list(forced), torch.int64, x.device)
            ids = queued_values([min(t, vocab - 1) for t, _ in forced.values()], torch.int64, x.device)
            tokens.index_copy_(0, at, ids)
        ids, codes, lps = token_reads(logprobs, x, tokens, vocab)
        tops = top_n(logprobs, [row.params.top_logprobs for row in rows])
        outputs = []
        for r, (row, t, c, lp, top) in enumerate(zip(rows, ids, codes, lps, tops)):
            t, error = forced.get(r, (t, BLOCKED[c]))  # a forced token needs no allowed one, only a valid id
            outputs.append(SampleOutput(t, lp if row.params.reports_logprobs else None, top, error))
        return outputs

    @staticmethod
    def _golden_(rows: list[SampleRow], vocab: int) -> dict[int, tuple[int, str | None]]:
        """golden_token_ids (DeepInfer's teacher forcing): the token of a row whose position the list covers is the
        forced one, not the drawn one (the grammar, if any, must still accept it). Returns {row: (token, error or
        None)}."""
        forced = {}
        for r, row in enumerate(rows):
            golden = row.params.golden_token_ids
            if golden and row.position < len(golden):
                t = golden[row.position]
                forced[r] = (t, None if t < vocab else f"SamplingParams.golden_token_ids[{row.position}]={t} is out "
                                                         f"of range; allowed: a token id < {vocab}")
        return forced

    def _logprobs_and_masked(self, logits, rows, bitmask, vocab):
        """Steps 0-3: the reported logprobs of the raw logits, and the logits after blacklist, grammar mask and
        penalties (what greedy takes the argmax of and sampling draws from)."""
        logprobs = raw_logprobs(logits, vocab, self.batch_invariant)
        x = logits.float().clone()
        self._blacklist_(x, rows, vocab)
        if bitmask is not None:
            apply_bitmask_(x, bitmask)
        self._penalties_(x, rows)
        self._logit_bias_(x, rows)
        return logprobs, x

    def _blacklist_(self, x: torch.Tensor, rows: list[SampleRow], vocab: int) -> None:
        x[:, vocab:] = float("-inf")
        for r, row in enumerate(rows):
            p = row.params
            banned = []
            if row.position < p.min_tokens:
                banned += p.stop_token_ids or []
                if self.eos_token_id is not None and not p.ignore_eos:
                    banned.append(self.eos_token_id)
            if row.position < p.first_n_token_no_eos:  # DeepInfer: eos_id (default the model's EOS) is never drawn
                eos = self.eos_token_id if p.eos_id is None else p.eos_id
                banned += [] if eos is None else [eos]
            banned = [t for t in banned if t < x.shape[1]]
            if banned:
                x[r].index_fill_(0, queued_values(banned, torch.int64, x.device), float("-inf"))

    def _penalties_(self, x: torch.Tensor, rows: list[SampleRow]) -> None:
        idx = [
            r
            for r, row in enumerate(rows)
            if row.params.repetition_penalty != 1.0
            or row.params.frequency_penalty != 0.0
            or row.params.presence_penalty != 0.0
        ]
        if not idx:
            return
        at = queued_values(idx, torch.int64, x.device)
        sub = x.index_select(0, at)
        width = sub.shape[1]
        out_counts = proc.token_counts([rows[r].output_ids for r in idx], width, x.device)
        rep = [rows[r].params.repetition_penalty for r in idx]
        if any(v != 1.0 for v in rep):
            prompt_counts = proc.token_counts([rows[r].prompt_ids for r in idx], width, x.device)
            proc.apply_repetition_penalty_(sub, (prompt_counts + out_counts) > 0, rep)
        proc.apply_additive_penalties_(
            sub,
            out_counts,
            [rows[r].params.frequency_penalty for r in idx],
            [rows[r].params.presence_penalty for r in idx],
        )
        x.index_copy_(0, at, sub)

    @staticmethod
    def _logit_bias_(x: torch.Tensor, rows: list[SampleRow]) -> None:
        for r, row in enumerate(rows):
            bias = row.params.logit_bias
            if bias:
                ids = [t for t in bias if t < x.shape[1]]
                if ids:
                    x[r].index_add_(0, queued_values(ids, torch.int64, x.device),
                                    queued_values([float(bias[t]) for t in ids], x.dtype, x.device))

    @staticmethod
    def _advance_grammars(rows: list[SampleRow], outputs: list[SampleOutput]) -> None:
        for row, out in zip(rows, outputs):
            if row.grammar_state is None or out.error is not None:
                continue
            if not row.grammar_state.accept_token(out.token_id):
                out.error = f"the grammar rejected token {out.token_id}"


NO_TOKEN_ALLOWED = "no token is allowed: the grammar and min_tokens exclude every token"
NOT_FINITE = "the model's logits are not finite (NaN or infinity) for this token: the step's numerics failed"


BLOCKED = (None, NO_TOKEN_ALLOWED, NOT_FINITE)  # by blocked_codes' value


def blocked_codes(x: torch.Tensor) -> torch.Tensor:
    """Per row of processed logits x, on x's device: 0 when a token can be chosen, 1 when every token is masked,
    2 when the model's logits are NaN or +inf where tokens are allowed (a masked position holds -inf whatever the
    model gave). One whole-step max; a NaN row would otherwise yield an arbitrary argmax as if it were a token."""
    top = row_max(x)
    return (top == float("-inf")).to(torch.int8) + 2 * (torch.isnan(top) | (top == float("inf"))).to(torch.int8)


def token_reads(logprobs: torch.Tensor, x: torch.Tensor, tokens: torch.Tensor, vocab: int):
    """Per row of processed logits x: the chosen token (a device tensor), its blocked_codes value and the raw
    logprob of that token, read back in one transfer (float64 holds the ids and the float32 logprobs exactly): each
    separate host read is a synchronisation that leaves the device idle while the host waits."""
    chosen = logprobs.gather(1, tokens.clamp(max=vocab - 1).unsqueeze(1)).squeeze(1)
    back = torch.stack([tokens.double(), blocked_codes(x).double(), chosen.double()]).tolist()
    return [int(t) for t in back[0]], [int(c) for c in back[1]], back[2]


def greedy_reads(logprobs: torch.Tensor, x: torch.Tensor, vocab: int) -> tuple[list[int], list[int], list[float]]:
    """token_reads of each row's argmax (ties: the lowest id): all a greedy step needs from the device."""
    return token_reads(logprobs, x, first_argmax(x), vocab)
