"""Speculative decoding in the sample stage: choosing drafts, and verifying them losslessly against the target.

Drafts (`DraftChooser`): per block position the drafter's logits go through the request's temperature, top-k, top-p
and min-p (not penalties or grammar: the draft distribution q may be anything, verification corrects for it); a
greedy request takes the argmax, a sampled one draws by inverse CDF with the uniform (seed, position, DRAFT, 0) and
keeps q's integer weights for verification.

Verification (`verify`), per request, over its k + 1 target rows (row j follows draft j, row 0 the anchor):
  - row j's target distribution p_j is exactly what plain decoding would sample from at that position: the same
    blacklist, grammar mask (the grammar advanced through drafts 1..j), penalties (drafts 1..j count as output),
    temperature, top-k/p and min-p (deepinfer.sampling.sampler);
  - greedy: draft j+1 is accepted while it equals argmax p_j; the token after the last accepted one is argmax p_m;
  - sampled: standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft d with
    probability min(1, p(d) / q(d)) using the uniform (seed, position, DRAFT, 1); at the first rejection draw from
    the residual max(0, p - q) with (seed, position, DRAFT, 2); when all k are accepted draw the bonus token from
    p_k with the plain (seed, position, TOKEN) uniform. The output distribution is then exactly p's.
`accept_sampled` is the per-request definition; the sampler verifies a step's sampled requests together with
`accept_sampled_rows` (the same verdicts, two host reads a step instead of four a draft).
Every uniform is a function of the request's seed and the output position only, so a run is reproduced by its
seq_seed whatever the batch (as long as the number of drafts verified per step is the same: verification length
chosen by measured timings, DEEPINFER_ENABLE_MTP_VARLEN, breaks that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

from deepinfer.sampling.fixed_point import draw_from_weights, draw_tokens, fixed_point_scale
from deepinfer.sampling.queued_copy import queued_values
from deepinfer.sampling.row_columns import processed_weights
from deepinfer.sampling.seeds import DrawKind, uniform
from deepinfer.sampling.wide_reduce import first_argmax

ACCEPT, RESIDUAL = 1, 2  # uniform indices within the DRAFT stream of a position (0 draws the draft itself)


@dataclass
class DraftRequest:
    params: object
    seed: int
    position: int  # output position of the block's first draft


class DraftChooser:
    """`choose(i, logits [N, V])` for DSpark.draft: picks block position i's drafts for each request and keeps
    the draft distributions of sampled requests (weights[r][i]: int64 [V], None for greedy requests)."""

    def __init__(self, requests: list[DraftRequest], vocab: int):
        self.requests, self.vocab = requests, vocab
        self.sampled = [r for r, q in enumerate(requests) if not q.params.greedy]
        self.greedy = [r for r, q in enumerate(requests) if q.params.greedy]
        self.weights: list[list] = [[] for _ in requests]

    def __call__(self, i: int, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float().clone()
        x[:, self.vocab:] = float("-inf")
        tokens = first_argmax(x)
        if self.sampled:
            reqs = [self.requests[r] for r in self.sampled]
            at = queued_values(self.sampled, torch.int64, x.device)
            w, cols = processed_weights(x.index_select(0, at), [q.params for q in reqs], self.vocab,
                                        [[uniform(q.seed, q.position + i, DrawKind.DRAFT)] for q in reqs])
            tokens.index_copy_(0, at, draw_tokens(w, cols.uniforms[:, 0]))
            for j, r in enumerate(self.sampled):
                self.weights[r].append(w[j])
        for r in self.greedy:
            self.weights[r].append(None)
        return tokens


@dataclass
class Verdict:
    """One request's verification: the tokens it appends (accepted drafts, then the target's own token)."""

    tokens: list[int]
    rows: list[int]  # the target row each token was chosen from (for its logprob)
    num_accepted: int
    error: str | None = None
    extra: dict = field(default_factory=dict)


def accept_greedy_ids(target: list[int], drafts: list[int]) -> Verdict:
    """target: the argmax of each of the k + 1 processed target rows (ties: lowest id). Accept while the draft is
    the target's argmax."""
    m = 0
    while m < len(drafts) and drafts[m] == target[m]:
        m += 1
    return Verdict(drafts[:m] + [target[m]], list(range(m + 1)), m)


def accept_sampled(p: torch.Tensor, q: list[torch.Tensor], drafts: list[int], seed: int, position: int) -> Verdict:
    """p: target integer weights [k + 1, V]; q[j]: the draft distribution draft j + 1 was drawn from (None: the
    draft was chosen deterministically, a point mass). `position`: the output position of row 0's token."""
    k = len(drafts)
    for j in range(k):
        d, pj = drafts[j], p[j]
        qj = q[j] if q is not None and q[j] is not None else _point_mass(d, pj)  # a draft chosen deterministically
        sp, sq = int(pj.sum()), int(qj.sum())
        pd, qd = int(pj[d]), int(qj[d])
        u = uniform(seed, position + j, DrawKind.DRAFT, ACCEPT)
        # accept with probability min(1, (pd/sp) / (qd/sq)), in exact rationals (u has 53 bits)
        if qd > 0 and sp > 0 and Fraction(u) * qd * sp < pd * sq:
            continue
        token = _draw_residual(pj, qj, sp, sq, uniform(seed, position + j, DrawKind.DRAFT, RESIDUAL))
        return Verdict(drafts[:j] + [token], list(range(j + 1)), j)
    bonus = draw_from_weights(p[k : k + 1], [uniform(seed, position + k, DrawKind.TOKEN)])[0]
    return Verdict(drafts + [bonus], list(range(k + 1)), k)


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1
    return q


def _draw_residual(p: torch.Tensor, q: torch.Tensor, sp: int, sq: int, u: float) -> int:
    """A draw from max(0, p/sp - q/sq), renormalised (row-local float64, then exact integer weights)."""
    r = (p.double() / sp - q.double() / sq).clamp_min(0)
    top = r.max()
    if top <= 0:  # p == q up to rounding: the rejection had probability ~0; fall back to p
        return draw_from_weights(p[None], [u])[0]
    w = torch.floor(r / top * fixed_point_scale(r.shape[-1])).to(torch.int64)
    return draw_from_weights(w[None], [u])[0]


@dataclass
class SampledDrafts:
    """One sampled request's part of a batched verification: its k drafts, their draft distributions (None, or
    None entries: drafts chosen deterministically, point masses), its seed and the output position of its row 0."""

    drafts: list[int]
    q: list | None
    seed: int
    position: int


def accept_sampled_rows(p: torch.Tensor, requests: list[SampledDrafts]) -> list[Verdict]:
    """accept_sampled for many requests at once, with the same verdicts: p [sum(k_i + 1), V] holds each request's
    k_i + 1 target rows in order. The acceptance tests' integers (each row's total, the draft's weight in p and
    in q) come to the host in one read and the tests run there in exact rationals; then every request's last token
    (the residual's draw at its first rejection, or the bonus token) is drawn on the device in one batch and read
    once: two synchronisations a verification, where request by request made four a draft."""
    dev, V = p.device, p.shape[-1]
    starts, tested, q_rows = [], [], []  # tested: (p row, draft, index into q_rows or -1) per draft, in order
    at = 0
    for req in requests:
        starts.append(at)
        for j, d in enumerate(req.drafts):
            qj = None if req.q is None else req.q[j]
            tested.append((at + j, d, -1 if qj is None else len(q_rows)))
            if qj is not None:
                q_rows.append(qj)
        at += len(req.drafts) + 1
    parts = [p.sum(dim=-1)]
    if tested:
        rows = queued_values([r for r, _, _ in tested], torch.int64, dev)
        ids = queued_values([d for _, d, _ in tested], torch.int64, dev)
        parts.append(p[rows, ids])
    if q_rows:
        q = torch.stack(q_rows)
        q_ids = queued_values([d for _, d, qi in tested if qi >= 0], torch.int64, dev)
        parts += [q.sum(dim=-1), q.gather(1, q_ids[:, None]).squeeze(1)]
    read = torch.cat(parts).tolist()
    n, t, m = p.shape[0], len(tested), len(q_rows)
    sp, pd, sq, qd = read[:n], read[n : n + t], read[n + t : n + t + m], read[n + t + m :]

    # per request its last row, that row's uniform and, at a rejection, (j, q row or None, draft, sp, sq)
    finals, ti = [], 0
    for s, req in zip(starts, requests):
        k, rejected = len(req.drafts), None
        for j in range(k):
            _, d, qi = tested[ti + j]
            sqj, qdj = (1, 1) if qi < 0 else (sq[qi], qd[qi])  # a point mass at the draft: weight 1 of 1
            spj, pdj = sp[s + j], pd[ti + j]
            u = uniform(req.seed, req.position + j, DrawKind.DRAFT, ACCEPT)
            if not (qdj > 0 and spj > 0 and Fraction(u) * qdj * spj < pdj * sqj):
                rejected = (j, None if qi < 0 else q_rows[qi], d, spj, sqj)
                break
        ti += k
        if rejected is None:
            finals.append((s + k, uniform(req.seed, req.position + k, DrawKind.TOKEN), None))
        else:
            j = rejected[0]
            finals.append((s + j, uniform(req.seed, req.position + j, DrawKind.DRAFT, RESIDUAL), rejected))

    w = p[queued_values([f[0] for f in finals], torch.int64, dev)]
    rej = [i for i, f in enumerate(finals) if f[2] is not None]
    if rej:
        pr = w[rej]
        qr = torch.zeros_like(pr)
        given = [row for row, i in enumerate(rej) if finals[i][2][1] is not None]
        if given:
            qr[given] = torch.stack([finals[rej[row]][2][1] for row in given])
        points = [(row, finals[i][2][2]) for row, i in enumerate(rej) if finals[i][2][1] is None]
        if points:
            at = queued_values([[r, d] for r, d in points], torch.int64, dev)
            qr[at[:, 0], at[:, 1]] = 1
        # _draw_residual's arithmetic row by row: p / sp - q / sq in float64, the clamp, the row max, the scale
        sp_col = queued_values([[float(finals[i][2][3])] for i in rej], torch.float64, dev)
        sq_col = queued_values([[float(finals[i][2][4])] for i in rej], torch.float64, dev)
        r = (pr.double() / sp_col - qr.double() / sq_col).clamp_min(0)
        top = r.max(dim=-1, keepdim=True).values
        scaled = torch.floor(r / torch.where(top > 0, top, 1.0) * fixed_point_scale(V)).to(torch.int64)
        w[rej] = torch.where(top > 0, scaled, pr)  # p == q up to rounding: p itself, as _draw_residual
    drawn = draw_tokens(w, queued_values([f[1] for f in finals], torch.float64, dev)).tolist()
    verdicts = []
    for req, f, token in zip(requests, finals, drawn):
        j = len(req.drafts) if f[2] is None else f[2][0]
        verdicts.append(Verdict(req.drafts[:j] + [token], list(range(j + 1)), j))
    return verdicts
