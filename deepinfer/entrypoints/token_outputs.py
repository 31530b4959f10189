"""DeepInfer's `decode_sequence=False` outputs: per request, one output per generated token, in order, the last one
`finished` (DeepInfer's engine returns a RequestOutput per request per step; its fields are named here as there).

A request that ended without a token (it failed at once, e.g. a schema that does not compile) has an empty list;
its error is logged (entrypoints/llm.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenOutput:
    request_id: str  # DeepInfer's: the request's index in the generate() call, as a string
    token_id: int
    token_logprobs: float | None = None  # the token's logprob (None unless logprobs were asked)
    top_token_ids: list[int] = field(default_factory=list)  # the top_logprobs alternatives
    top_logprobs: list[float] = field(default_factory=list)
    num_output_tokens: int = 0  # tokens generated up to and including this one
    prompt_len: int = 0
    prompt_logprobs: list[float] | None = None  # on the first output, when prompt_logprobs were asked
    finished: bool = False
    finish_reason: str | None = None  # on the last: stop | length | abort | error


def per_token(index: int, output) -> list[TokenOutput]:
    """A deepinfer.RequestOutput -> DeepInfer's per-token outputs."""
    outs = []
    lps = output.logprobs or []
    for i, token in enumerate(output.token_ids):
        lp = lps[i] if i < len(lps) else None
        outs.append(TokenOutput(
            request_id=str(index), token_id=token,
            token_logprobs=None if lp is None else lp.logprob,
            top_token_ids=[t for t, _ in ((lp.top_logprobs or []) if lp is not None else [])],
            top_logprobs=[v for _, v in ((lp.top_logprobs or []) if lp is not None else [])],
            num_output_tokens=i + 1, prompt_len=len(output.prompt_token_ids)))
    if outs:
        if output.prompt_logprobs is not None:
            outs[0].prompt_logprobs = [None if p is None else p.logprob for p in output.prompt_logprobs]
        outs[-1].finished, outs[-1].finish_reason = True, output.finish_reason
    return outs
