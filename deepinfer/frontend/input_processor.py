"""The input processor: everything a request goes through on its way in, once, for every frontend (LLM.generate,
generate_iter, the OpenAI server).

- prompts in any accepted shape -> (text, token ids) pairs; sampling params one for all or one per prompt;
- validation: the prompt (a string, or a list of integer token ids) and the params (`params_error`: the
  constructor's checks again, since a dataclass field may be reassigned after construction);
- the per-request seed rule (`deepinfer.sampling.seeds.seed_for`): the request's seq_seed, else
  child_seed(runtime.seed, request id), else a random seed;
- n > 1: n engine requests of n=1; sample i draws with child_seed(seed, i) (sample 0 keeps the seed, so n=1 and the
  first of n samples agree).

Request ids are the caller-visible ones (RequestOutput.request_id, the seed source): a running count over the
frontend's lifetime unless the caller names them; sample i > 0 of a prompt takes the next free id.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from deepinfer.sampling.params import SamplingParams, params_error
from deepinfer.sampling.seeds import child_seed, seed_for


@dataclass
class EngineInput:
    """One engine request: one sample of one prompt, validated and seeded (or `error` set: it never runs)."""

    index: int  # the prompt's position in the caller's list
    sample: int  # which of the prompt's n samples
    request_id: int  # the caller-visible id
    prompt: str | None
    prompt_ids: list[int]
    params: Any
    seed: int | None = None
    error: str | None = None


class InputProcessor:
    """encode: text -> token ids (None: token ids only). base_seed: runtime.seed (None: random per request)."""

    def __init__(self, encode: Callable[[str], list[int]] | None = None, base_seed: int | None = None):
        self.encode = encode
        self.base_seed = base_seed
        self._ids = itertools.count()

    def next_id(self) -> int:
        return next(self._ids)

    def process(self, index: int, prompt: str | None, prompt_ids, params, request_id: int | None = None
                ) -> list[EngineInput]:
        """The engine requests for one prompt: n of them, or one with `error` set."""
        rid = self.next_id() if request_id is None else request_id
        error, ids = self._prompt_error(prompt, prompt_ids), []
        if error is None:
            ids = list(prompt_ids) if prompt_ids is not None else list(self.encode(prompt))
            if not all(type(t) is int for t in ids):
                error = "prompt token ids must be integers"
            else:
                error = params_error(params)
        if error is not None:
            return [EngineInput(index, 0, rid, prompt, ids, params, error=error)]
        seed = seed_for(params.seq_seed, self.base_seed, rid)
        if params.n == 1:
            return [EngineInput(index, 0, rid, prompt, ids, params, seed)]
        out = []
        for i in range(params.n):
            s = child_seed(seed, i)
            out.append(EngineInput(index, i, rid if i == 0 else self.next_id(), prompt, ids,
                                   dataclasses.replace(params, n=1, seq_seed=s), s))
        return out

    def process_all(self, items, params: Sequence, request_ids: Sequence[int] | None = None) -> list[EngineInput]:
        """items: (text, token ids) pairs (see `normalize_prompts`); params: one per item."""
        ids = request_ids if request_ids is not None else [None] * len(items)
        if not len(items) == len(params) == len(ids):
            raise ValueError(f"{len(items)} prompts but {len(params)} sampling params, {len(ids)} ids")
        out: list[EngineInput] = []
        for i, ((text, tok), sp, rid) in enumerate(zip(items, params, ids)):
            out += self.process(i, text, tok, sp, rid)
        return out

    def _prompt_error(self, prompt, prompt_ids) -> str | None:
        if prompt_ids is not None:
            if not isinstance(prompt_ids, list):
                return f"prompt_token_ids={prompt_ids!r} is not a list of token ids"
            return None
        if not isinstance(prompt, str):
            return f"prompt {prompt!r} is not a string"
        if self.encode is None:
            return "text prompts need a tokenizer, and this engine was built without one"
        return None


def normalize_prompts(prompts, prompt_token_ids) -> list[tuple[str | None, Any]]:
    """(text, token ids) per prompt. prompts: a text, a list of texts, lists of token ids or {"prompt": ...} /
    {"prompt_token_ids": [...]} dicts; or prompt_token_ids=[[...], ...]. Ids that are not a list stay as they are:
    the input processor answers that request alone with an error."""
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("generate: pass prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        return [(None, list(ids)) for ids in prompt_token_ids]
    if prompts is None:
        raise ValueError("generate: prompts or prompt_token_ids is required")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    items = []
    for p in prompts:
        if isinstance(p, dict):
            ids = p.get("prompt_token_ids")
            items.append((p.get("prompt"), list(ids) if isinstance(ids, (list, tuple)) else ids))
        elif isinstance(p, (list, tuple)):
            items.append((None, list(p)))
        else:
            items.append((p, None))
    return items


def per_prompt(sampling_params, n: int, default: Callable[[], SamplingParams] | None = None) -> list:
    """One SamplingParams per prompt: `sampling_params` for all (one object, or a list of n), or default()."""
    if sampling_params is None:
        if default is None:
            raise ValueError("generate: sampling_params is required")
        return [default() for _ in range(n)]
    if not isinstance(sampling_params, (list, tuple)):
        return [sampling_params] * n
    sampling_params = list(sampling_params)
    if len(sampling_params) != n:
        raise ValueError(f"generate: {len(sampling_params)} sampling_params for {n} prompts; allowed: 1 or {n}")
    return sampling_params
