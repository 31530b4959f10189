"""Logprobs reported to the user: log_softmax of the model's raw logits (before penalties, masks, temperature and
truncation, as OpenAI and vLLM report them), for the chosen token and the N most likely alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sampling.fixed_point import fixed_point_scale, fixed_point_weights


@dataclass
class SampleOutput:
    """One row's result. token_id: the drawn token. logprob: its raw logprob. top_logprobs: the params'
    top_logprobs most likely (token_id, logprob) pairs, most likely first, ties by lowest id; None when 0.
    error: a one-line message when the row could not be sampled (the engine ends that request with
    finish_reason="error"); token_id is then meaningless."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    error: str | None = None


def raw_logprobs(logits: torch.Tensor, vocab_size: int, batch_invariant: bool = False) -> torch.Tensor:
    """float32 [rows, vocab_size]: log_softmax over the real vocabulary (padding columns excluded).

    batch_invariant: normalise with an exact integer sum (``fixed_point_weights``) instead of log_softmax's float
    reduction, whose schedule may follow the batch shape; relative error of the normaliser below 1e-8."""
    x = logits[:, :vocab_size].float()
    if not batch_invariant:
        return torch.log_softmax(x, dim=-1)
    weights = fixed_point_weights(x)
    scale = fixed_point_scale(x.shape[-1])
    log_z = torch.log(weights.sum(dim=-1, keepdim=True).double() / scale)
    top = x.max(dim=-1, keepdim=True).values.double()
    return (x.double() - top - log_z).float()


def top_n(logprobs: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]] | None]:
    """Per row, the counts[r] largest (token_id, logprob) pairs; None where counts[r] == 0.

    A stable descending sort (not torch.topk, whose tie order is unspecified) so equal logprobs list in id order."""
    result: list[list[tuple[int, float]] | None] = [None] * len(counts)
    wanted = [r for r, c in enumerate(counts) if c > 0]
    if not wanted:
        return result
    n = min(max(counts[r] for r in wanted), logprobs.shape[-1])
    values, ids = torch.sort(logprobs[wanted], dim=-1, descending=True, stable=True)
    values, ids = values[:, :n].tolist(), ids[:, :n].tolist()
    for j, r in enumerate(wanted):
        c = counts[r]
        result[r] = list(zip(ids[j][:c], values[j][:c]))
    return result


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: list[int], top_logprobs: int, vocab_size: int, batch_invariant: bool = False
) -> list[SampleOutput | None]:
    """Logprobs of the prompt's own tokens. logits: [len(prompt_ids), vocab], row i = the model's prediction
    after prompt_ids[: i + 1] (the engine may pass only the first len-1 rows; the last row is not needed).
    Entry 0 is None (nothing predicts the first token); entry i > 0 scores prompt_ids[i] with row i - 1."""
    count = len(prompt_ids) - 1
    out: list[SampleOutput | None] = [None]
    if count <= 0:
        return out
    lp = raw_logprobs(logits[:count], vocab_size, batch_invariant)
    targets = torch.tensor(prompt_ids[1:], dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    tops = top_n(lp, [top_logprobs] * count)
    out.extend(SampleOutput(t, c, tp) for t, c, tp in zip(prompt_ids[1:], chosen, tops))
    return out
