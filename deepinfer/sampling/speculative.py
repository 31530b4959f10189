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
Every uniform is a function of the request's seed and the output position only, so a run is reproduced by its
seq_seed whatever the batch (as long as the number of drafts verified per step is the same: verification length
chosen by measured timings, DEEPINFER_ENABLE_MTP_VARLEN, breaks that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

from deepinfer.sampling import processors as proc
from deepinfer.sampling.fixed_point import draw_from_weights, fixed_point_scale, fixed_point_weights
from deepinfer.sampling.seeds import DrawKind, uniform

ACCEPT, RESIDUAL = 1, 2  # uniform indices within the DRAFT stream of a position (0 draws the draft itself)


def processed_weights(x: torch.Tensor, params: list) -> torch.Tensor:
    """Integer weights of the distribution a sampled row draws from: temperature, top-k/p, min-p (in place on x)."""
    proc.apply_temperature_(x, [p.temperature for p in params])
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        proc.apply_top_k_top_p_(x, [p.top_k for p in params], [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        proc.apply_min_p_(x, [p.min_p for p in params])
    return fixed_point_weights(x)


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
        tokens = x.argmax(dim=-1)
        if self.sampled:
            reqs = [self.requests[r] for r in self.sampled]
            w = processed_weights(x[self.sampled], [q.params for q in reqs])
            drawn = draw_from_weights(w, [uniform(q.seed, q.position + i, DrawKind.DRAFT) for q in reqs])
            tokens[self.sampled] = torch.tensor(drawn, dtype=tokens.dtype, device=tokens.device)
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
