"""The image span in the prompt (VISION_SPEC.md §6): [START] + ([IMAGE] x w + [NEWLINE]) x h + [END] per image.

Two halves, both pure: the ids and token types of the expanded prompt (what the scheduler and the text model's
masks see) and the embedding rows that replace the span positions (what the text model's first layer sees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from .errors import ImageInputError
from .geometry import ImageLayout


class TokenType(IntEnum):
    """DeepInfer's per-token roles (`mm_token_type`); the ids alone do not say what a span position is."""

    TEXT = 0
    IMAGE = 2
    IMAGE_START = 3
    IMAGE_END = 4
    IMAGE_NEW_LINE = 5


# DeepInfer's engine-side span ids are vocab_size + offset (ImageTokenOffset): sentinels >= vocab can never collide
# with a real token, and Engram maps them to dead without a lookup. Only IMAGE and PAD appear in prompts.
IMAGE_ID_OFFSET = 2  # the span's first position ("the first token must be IMAGE for chunked prefill")
PAD_ID_OFFSET = 1  # every other span position
SPAN_ID_COUNT = 5  # vocab+0 .. vocab+4 (START, PAD, IMAGE, NEW_LINE, END): the ids a prompt may hold past the vocab


def span_types(layout: ImageLayout) -> list[TokenType]:
    row = [TokenType.IMAGE] * layout.n_llm_w + [TokenType.IMAGE_NEW_LINE]
    return [TokenType.IMAGE_START] + row * layout.n_llm_h + [TokenType.IMAGE_END]


@dataclass
class ExpandedPrompt:
    input_ids: torch.Tensor  # int64 [L]: DeepInfer's form, vocab+2 then vocab+1s in each span
    input_ids_hf: torch.Tensor  # int64 [L]: the HF convention, image_token_id at every span position
    mm_token_type: torch.Tensor  # int32 [L]: TokenType per position
    image_spans: list[tuple[int, int]]  # (start, length) per image, in prompt order

    @property
    def images_seq_mask(self) -> torch.Tensor:
        """Every span position, START/NEWLINE/END included: routed with ffn.gate.bias_vl, dead for Engram."""
        return self.mm_token_type >= TokenType.IMAGE


def expand_prompt(prompt_ids: Sequence[int], layouts: Sequence[ImageLayout], image_token_id: int,
                  vocab_size: int) -> ExpandedPrompt:
    """Each `image_token_id` placeholder (one per image, matched in order) becomes that image's span. A count
    that differs from the number of images is an error (the servers' strict rule, VISION_SPEC.md §8 #9)."""
    ids = [int(t) for t in prompt_ids]
    placeholders = sum(t == image_token_id for t in ids)
    if placeholders != len(layouts):
        raise ImageInputError(f"{placeholders} image placeholders (id {image_token_id}) in the prompt for "
                              f"{len(layouts)} images; allowed: one placeholder per image")
    out_ids, hf_ids, types, spans = [], [], [], []
    images = iter(layouts)
    for t in ids:
        if t != image_token_id:
            out_ids.append(t), hf_ids.append(t), types.append(TokenType.TEXT)
            continue
        layout = next(images)
        n = layout.num_tokens
        spans.append((len(out_ids), n))
        out_ids += [vocab_size + IMAGE_ID_OFFSET] + [vocab_size + PAD_ID_OFFSET] * (n - 1)
        hf_ids += [image_token_id] * n
        types += span_types(layout)
    return ExpandedPrompt(torch.tensor(out_ids, dtype=torch.int64), torch.tensor(hf_ids, dtype=torch.int64),
                          torch.tensor(types, dtype=torch.int32), spans)


def span_rows(image_embeds: torch.Tensor, layout: ImageLayout, start: torch.Tensor, newline: torch.Tensor,
              end: torch.Tensor) -> torch.Tensor:
    """One image's span embedding rows [num_tokens, hidden]: `start`, then each LLM-grid row's aligner rows followed
    by `newline`, then `end`. image_embeds [n_llm_h * n_llm_w, hidden] in reading order."""
    if image_embeds.shape[0] != layout.num_image_tokens:
        raise ValueError(f"{image_embeds.shape[0]} image rows for a {layout.n_llm_h} x {layout.n_llm_w} grid")
    grid = image_embeds.reshape(layout.n_llm_h, layout.n_llm_w, -1)
    nl = newline.to(image_embeds.dtype).expand(layout.n_llm_h, 1, -1)
    body = torch.cat([grid, nl], dim=1).reshape(-1, image_embeds.shape[-1])
    return torch.cat([start.to(body.dtype)[None], body, end.to(body.dtype)[None]])


def merge_spans(embeds: torch.Tensor, image_spans: Sequence[tuple[int, int]],
                rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The prompt's embeddings [L, hidden] with each image span's positions replaced by its rows (every span row
    is replaced, so what the span ids embed to never matters); text rows untouched. Returns a new tensor."""
    out = embeds.clone()
    for (start, length), r in zip(image_spans, rows, strict=True):
        if r.shape[0] != length:
            raise ValueError(f"span at {start} has {length} positions but {r.shape[0]} rows")
        out[start:start + length] = r.to(out.dtype)
    return out
