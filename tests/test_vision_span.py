"""The image span in the prompt against the golden fixture tiny-vit2 (VISION_SPEC.md §6): each placeholder becomes
[START] + ([IMAGE] x w + [NEWLINE]) x h + [END]; the ids in DeepInfer's form (vocab+2, then vocab+1s) and the HF
form, the token types and the image mask all exact; the span rows land on exactly the span positions."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models.vision import ImageInputError, VisionConfig, plan_image
from deepinfer.models.vision.loading import load_vision_model
from deepinfer.models.vision.span import TokenType, expand_prompt, merge_spans, span_rows
from vision_fixture import VISION_FIXTURE, case, geometry, stored

CFG = VisionConfig.from_file(VISION_FIXTURE)


def _layouts(cases):
    return [plan_image(geometry(n)["width"], geometry(n)["height"], CFG) for n in cases]


def _expand(prompt, cases):
    return expand_prompt(prompt.tolist(), _layouts(cases), CFG.image_token_id, CFG.vocab_size)


@pytest.mark.parametrize("key, cases", [("case0", [0]), ("case1", [1]), ("case2", [2]), ("multi", [0, 2])])
def test_expanded_ids_types_and_mask_exact(key, cases):
    s = stored()
    got = _expand(s[f"{key}.prompt_ids"], cases)
    assert torch.equal(got.input_ids, s[f"{key}.input_ids"])
    assert torch.equal(got.input_ids_hf, s[f"{key}.input_ids_hf"])
    assert torch.equal(got.mm_token_type, s[f"{key}.mm_token_type"])
    assert torch.equal(got.images_seq_mask, s[f"{key}.images_seq_mask"])
    if key == "multi":
        assert got.image_spans == [tuple(x) for x in s["multi.image_spans"].tolist()] == [(16, 10), (27, 7)]
    else:
        assert got.image_spans == [tuple(geometry(cases[0])["image_span"])]


def test_span_ids_are_sentinels_above_the_vocabulary():
    """The span's first position is vocab+2 (IMAGE), the rest vocab+1 (PAD): never a real token id; text ids
    are unchanged and every span position is in the image mask, START/NEWLINE/END included."""
    got = _expand(stored()["multi.prompt_ids"], [0, 2])
    for start, length in got.image_spans:
        assert got.input_ids[start] == CFG.vocab_size + 2
        assert (got.input_ids[start + 1:start + length] == CFG.vocab_size + 1).all()
        assert got.mm_token_type[start] == TokenType.IMAGE_START
        assert got.mm_token_type[start + length - 1] == TokenType.IMAGE_END
        assert got.images_seq_mask[start:start + length].all()
    assert int(got.images_seq_mask.sum()) == 10 + 7
    text = ~got.images_seq_mask
    assert (got.input_ids[text] < CFG.vocab_size).all() and torch.equal(got.input_ids[text], got.input_ids_hf[text])


def test_placeholder_count_must_equal_image_count():
    prompt = stored()["multi.prompt_ids"]  # two placeholders
    for cases in ([0], [0, 1, 2]):
        with pytest.raises(ImageInputError, match=f"2 image placeholders \\(id 511\\) in the prompt for "
                                                   f"{len(cases)} images; allowed: one placeholder per image"):
            _expand(prompt, cases)


def test_span_rows_replace_exactly_the_span_positions():
    """The function the engine will call after the embedding lookup: the two images' rows written over their
    spans of the two-image prompt, the text rows left as they were."""
    model = load_vision_model(VISION_FIXTURE)
    got = _expand(stored()["multi.prompt_ids"], [0, 2])
    gen = torch.Generator().manual_seed(1)
    text_embeds = torch.randn(got.input_ids.shape[0], CFG.text_hidden_size, generator=gen)
    rows = [span_rows(case(n, "image_embeds"), layout, model.image_start, model.image_newline, model.image_end)
            for n, layout in zip((0, 2), _layouts([0, 2]))]
    merged = merge_spans(text_embeds, got.image_spans, rows)
    (s0, n0), (s2, n2) = got.image_spans
    assert torch.equal(merged[s0:s0 + n0], case(0, "span_embeds"))
    assert torch.equal(merged[s2:s2 + n2], case(2, "span_embeds"))
    text = ~got.images_seq_mask
    assert torch.equal(merged[text], text_embeds[text])
