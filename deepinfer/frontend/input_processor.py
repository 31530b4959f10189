"""The input processor: everything a request goes through on its way in, once, for every frontend (LLM.generate,
generate_iter, the OpenAI server).

- prompts in any accepted shape -> (text, token ids, cache salt) triples; sampling params one for all or one per
  prompt;
- validation: the prompt (a string, or a list of integer token ids), its cache salt and the params (`params_error`:
  the constructor's checks again, since a dataclass field may be reassigned after construction);
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

from deepinfer.engine.prefix_cache import cache_salt_error
from deepinfer.frontend.images import ImagePrompts, parse_multi_modal_data
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
    images: list = dataclasses.field(default_factory=list)  # messages.ImageInput per image, spans in prompt_ids
    cache_salt: str | None = None  # prefix caching: only requests with the same salt share cached prefixes


class InputProcessor:
    """encode: text -> token ids (None: token ids only). base_seed: runtime.seed (None: random per request).
    images: the model's frontend/images.py ImagePrompts (None: images are refused as for a text-only model)."""

    def __init__(self, encode: Callable[[str], list[int]] | None = None, base_seed: int | None = None,
                 images: ImagePrompts | None = None):
        self.encode = encode
        self.base_seed = base_seed
        self.images = images if images is not None else ImagePrompts(None)
        self._ids = itertools.count()

    def next_id(self) -> int:
        return next(self._ids)

    def process(self, index: int, prompt: str | None, prompt_ids, params, request_id: int | None = None,
                multi_modal_data=None, spans: list | None = None, cache_salt: str | None = None) -> list[EngineInput]:
        """The engine requests for one prompt: n of them, or one with `error` set. multi_modal_data: DeepInfer's
        dict ({"image_bytes": [...], "image_sizes": [...]}), which expands the prompt's placeholders into image
        spans; spans: the ImageInputs of a prompt already expanded (the servers expand while converting, so a bad
        image is a 400 naming its content part). cache_salt: vLLM's per-request salt (a non-empty string) mixed into
        the root of its prefix-cache hashes: only requests with the same salt (or none) share cached prefixes."""
        rid = self.next_id() if request_id is None else request_id
        error, ids = self._prompt_error(prompt, prompt_ids) or cache_salt_error(cache_salt), []
        if error is None:
            ids = list(prompt_ids) if prompt_ids is not None else list(self.encode(prompt))
            if not all(type(t) is int for t in ids):
                error = "prompt token ids must be integers"
            else:
                error = params_error(params)
        spans = list(spans or [])
        if error is None and multi_modal_data is not None:
            try:
                ids, spans = self.images.expand(ids, *parse_multi_modal_data(multi_modal_data))
            except ValueError as exc:
                error = str(exc)
        if error is not None:
            return [EngineInput(index, 0, rid, prompt, ids, params, error=error)]
        seed = seed_for(params.seq_seed, self.base_seed, rid)
        if params.n == 1:
            return [EngineInput(index, 0, rid, prompt, ids, params, seed, images=spans, cache_salt=cache_salt)]
        out = []
        for i in range(params.n):
            s = child_seed(seed, i)
            out.append(EngineInput(index, i, rid if i == 0 else self.next_id(), prompt, ids,
                                   dataclasses.replace(params, n=1, seq_seed=s), s, images=spans,
                                   cache_salt=cache_salt))
        return out

    def process_all(self, items, params: Sequence, request_ids: Sequence[int] | None = None,
                    multi_modal_data: Sequence | None = None) -> list[EngineInput]:
        """items: (text, token ids, cache salt) triples (see `normalize_prompts`); params: one per item;
        multi_modal_data: one dict (or None) per item."""
        ids = request_ids if request_ids is not None else [None] * len(items)
        mm = multi_modal_data if multi_modal_data is not None else [None] * len(items)
        if not len(items) == len(params) == len(ids) == len(mm):
            raise ValueError(f"{len(items)} prompts but {len(params)} sampling params, {len(ids)} ids, "
                             f"{len(mm)} multi_modal_data")
        out: list[EngineInput] = []
        for i, ((text, tok, salt), sp, rid, data) in enumerate(zip(items, params, ids, mm)):
            out += self.process(i, text, tok, sp, rid, data, cache_salt=salt)
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


def normalize_prompts(prompts, prompt_token_ids) -> list[tuple[str | None, Any, Any]]:
    """(text, token ids, cache salt) per prompt. prompts: a text, a list of texts, lists of token ids or
    {"prompt": ...} / {"prompt_token_ids": [...]} dicts, which may carry vLLM's "cache_salt"; or
    prompt_token_ids=[[...], ...]. Ids that are not a list (or a salt that is not a string) stay as they are: the
    input processor answers that request alone with an error."""
    if prompts is not None and prompt_token_ids is not None:
        raise ValueError("generate: pass prompts or prompt_token_ids, not both")
    if prompt_token_ids is not None:
        return [(None, list(ids), None) for ids in prompt_token_ids]
    if prompts is None:
        raise ValueError("generate: prompts or prompt_token_ids is required")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    items = []
    for p in prompts:
        if isinstance(p, dict):
            ids = p.get("prompt_token_ids")
            items.append((p.get("prompt"), list(ids) if isinstance(ids, (list, tuple)) else ids, p.get("cache_salt")))
        elif isinstance(p, (list, tuple)):
            items.append((None, list(p), None))
        else:
            items.append((p, None, None))
    return items


def per_prompt_images(multi_modal_data, n: int) -> list | None:
    """One multi_modal_data dict (or None) per prompt, in DeepInfer's form: a dict for a single prompt, a list of
    dicts (one per prompt, in order) for several."""
    if multi_modal_data is None:
        return None
    if isinstance(multi_modal_data, dict):
        if n != 1:
            raise ValueError(f"generate: one multi_modal_data dict for {n} prompts; allowed: a list of {n} dicts "
                             "(one per prompt, None for a prompt without images)")
        return [multi_modal_data]
    if not isinstance(multi_modal_data, (list, tuple)) or len(multi_modal_data) != n:
        raise ValueError(f"generate: multi_modal_data must be a dict (one prompt) or a list of {n} dicts (one per "
                         "prompt)")
    return list(multi_modal_data)


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
