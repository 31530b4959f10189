"""Image input through the engine and both Python APIs, on embedded:tiny-random-vision (CPU): LLM.generate(...,
multi_modal_data=...) in DeepInfer's form, the images carried to the engine core with the request (typed messages),
the ViT run at prefill, and the span expanded in RequestOutput.prompt_token_ids."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine import messages as m
from deepinfer.engine.ipc import FRONTEND, Signer, Verifier, new_key
from vision_fixture import png

MODEL = "embedded:tiny-random-vision"
IMAGE = 519  # the model's image_token_id (<｜image｜>)
VOCAB = 528
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = [11, 12, IMAGE, 13, 14, 15]
TWO = [11, IMAGE, 12, IMAGE, 13, 14]
LONG = [11, 12, IMAGE] + list(range(20, 45))


def images(*cases, sizes=False):
    data = {"image_bytes": [png(n) for n in cases]}
    if sizes:
        from PIL import Image
        import io

        data["image_sizes"] = [list(Image.open(io.BytesIO(png(n))).size) for n in cases]
    return data


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, process="inproc", runtime={"num_threads": 1}) as llm:
        yield llm


def generate(llm, prompts, mm, params=GREEDY):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, multi_modal_data=mm, use_tqdm=False)


def test_generation_with_an_image_is_deterministic_and_differs_from_text_only(llm):
    first, again = (generate(llm, [PROMPT], [images(0)])[0] for _ in range(2))
    text = generate(llm, [PROMPT], None)[0]
    assert first.error is None and first.finish_reason == "length"
    assert first.token_ids == again.token_ids
    assert first.token_ids != text.token_ids


def test_prompt_token_ids_show_the_expanded_span(llm):
    out = generate(llm, [PROMPT], [images(1)])[0]
    ids = out.prompt_token_ids
    span = len(ids) - (len(PROMPT) - 1)
    assert ids[:2] == PROMPT[:2] and ids[2 + span:] == PROMPT[3:]
    assert ids[2] == VOCAB + 2 and ids[3:2 + span] == [VOCAB + 1] * (span - 1)


def test_a_multi_image_prompt_works_and_each_image_matters(llm):
    a, b, same = generate(llm, [TWO, TWO, TWO], [images(0, 2), images(2, 0), images(0, 2)])
    assert a.error is None and a.token_ids == same.token_ids
    assert a.token_ids != b.token_ids
    assert sum(t >= VOCAB for t in a.prompt_token_ids) == sum(t >= VOCAB for t in b.prompt_token_ids)
    assert generate(llm, [PROMPT], [images(2)])[0].token_ids != generate(llm, [PROMPT], [images(0)])[0].token_ids


def test_an_image_request_gives_the_same_tokens_alone_batched_with_text_and_chunked(llm):
    alone = generate(llm, [PROMPT], [images(0)])[0].token_ids
    batched = generate(llm, [[5, 6, 7, 8], PROMPT, [9, 10]], [None, images(0), None])
    assert batched[1].token_ids == alone
    with LLM(MODEL, process="inproc", runtime={"num_threads": 1},
             engine={"chunked_prefill": True, "max_num_batched_tokens": 5}) as small:
        chunked = generate(small, [PROMPT, [5, 6, 7, 8, 9, 10, 11]], [images(0), None])
    assert chunked[0].token_ids == alone  # 5-token steps cut the image span (positions 2..) several times


def test_preemption_and_recompute_keep_the_image(llm):
    """A cache too small for three image requests at once: they are preempted and recomputed (the ViT runs again
    from the patches the request keeps) and give the tokens they give with room to spare."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    mm = [images(0), images(2), images(1)]
    roomy = [o.token_ids for o in generate(llm, [PROMPT] * 3, mm, params)]
    with LLM(MODEL, process="inproc", runtime={"num_threads": 1},
             cache={"memory_budget": 40000, "block_size": 16, "prefix_caching": False},
             engine={"max_num_seqs": 3}) as tight:
        outs = generate(tight, [PROMPT] * 3, mm, params)
        assert tight._engine.client.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == roomy


def test_declared_sizes_are_checked_against_the_decoded_image(llm):
    assert generate(llm, [PROMPT], [images(0, sizes=True)])[0].token_ids == generate(llm, [PROMPT], [images(0)])[0].token_ids
    wrong = {"image_bytes": [png(0)], "image_sizes": [[1, 2]]}
    out = generate(llm, [PROMPT], [wrong])[0]
    assert out.finish_reason == "error"
    assert out.error.startswith("multi_modal_data.image_sizes[0] is 1 x 2 but the image decodes to ")


@pytest.mark.parametrize("mm, message", [
    ({"image_bytes": [b"\x89PNG\r\n\x1a\n broken"]}, "multi_modal_data.image_bytes[0]: "),
    ({"image_bytes": [png(0), png(1)]}, "multi_modal_data: 1 image placeholders (id 519) in the prompt for 2 images; "
                                        "allowed: one placeholder per image"),
    ({"images": [png(0)]}, "multi_modal_data has unknown keys ['images']; allowed: image_bytes, image_sizes"),
    ({"image_bytes": None}, "multi_modal_data.image_bytes is None"),
    ({"image_bytes": ["not bytes"]}, "multi_modal_data.image_bytes must be a list of bytes"),
])
def test_bad_image_input_ends_the_request_with_one_line_naming_the_field(llm, mm, message):
    out, fine = generate(llm, [PROMPT, PROMPT], [mm, None])
    assert out.finish_reason == "error" and out.error.startswith(message) and "\n" not in out.error
    assert fine.error is None  # the others run


def test_a_text_only_model_refuses_images_in_one_line():
    with LLM("embedded:tiny-random", process="inproc", runtime={"num_threads": 1}) as text:
        out = generate(text, [PROMPT], [images(0)])[0]
    assert out.finish_reason == "error"
    assert out.error == ("multi_modal_data: this model has no vision tower (no vision_config, or no vision.* / "
                         "aligner.* tensors in its checkpoint); allowed: text-only prompts")


def test_deepinfer_dropin_takes_multi_modal_data_in_its_form(llm):
    from deepinfer.entrypoints.llm import LLM as DeepInferLLM
    from deepinfer.sampling_params import SamplingParams as DeepInferParams

    ours = generate(llm, [PROMPT], [images(2)])[0].token_ids
    with DeepInferLLM(MODEL, process="inproc") as di:
        text = di.generate(prompt_token_ids=[PROMPT], sampling_params=DeepInferParams(temperature=0.0, max_tokens=12,
                                                                                       ignore_eos=True),
                           multi_modal_data=[images(2, sizes=True)], use_tqdm=False)[0]
        assert text == di.get_tokenizer().decode(ours, skip_special_tokens=False)
        prompt = di.get_tokenizer().decode([11, 12]) + "<｜image｜>" + di.get_tokenizer().decode([13, 14, 15])
        assert di.generate(prompt, DeepInferParams(temperature=0.0, max_tokens=4), multi_modal_data=images(2),
                           use_tqdm=False)[0]


def test_images_cross_to_the_core_as_typed_messages():
    req = m.AddRequest(1, [0, VOCAB + 2, VOCAB + 1, 5], SamplingParams(max_tokens=3), 9,
                       [m.ImageInput(1, 2, 42, 28, 40, 20, bytes(range(256)) * 9 + bytes(96))])
    key = new_key()
    msg = Verifier(key, FRONTEND, m.TO_CORE).unpack(Signer(key, FRONTEND).pack(m.to_wire([req])))
    assert m.from_wire(msg.requests[0]) == req
    bad = m.WireRequest(2, [0], {"max_tokens": 3}, 0, [{"data": 5, "start": 0, "length": 1}])
    update = m.from_wire(bad)
    assert update.finish_reason == "error" and update.error.startswith("the request's images must be a list of")


def test_each_image_is_decoded_once_on_its_way_in(llm, monkeypatch):
    """The frontend decodes, plans and resizes each image once; the core and the model take its resized pixels.
    Every Pillow open is counted, in whichever thread it runs: three images, three decodes."""
    from PIL import Image

    opened, real = [], Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(1) or real(*a, **k))
    outs = generate(llm, [TWO, PROMPT], [images(0, 2), images(1)])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert len(opened) == 3


def _core_images(**change):
    """prepare_images on one ImageInput of the tiny model (a 3 x 3-patch canvas: a 1 x 1 LLM grid, 4 span tokens),
    with `change` applied; the prompt holds the span at position 1."""
    from types import SimpleNamespace

    import msgspec

    from deepinfer.engine.images import prepare_images
    from deepinfer.models.vision import VisionConfig
    from deepinfer.models.vision import tiny

    cfg = VisionConfig.from_dict(tiny.with_vision({"hidden_size": 128, "vocab_size": VOCAB}))
    im = msgspec.structs.replace(m.ImageInput(1, 4, 42, 42, 40, 30, bytes(40 * 30 * 3)), **change)
    ids = [7] + [VOCAB + 2] + [VOCAB + 1] * 3 + [8]
    return prepare_images([im], ids, SimpleNamespace(cfg=cfg), VOCAB)


@pytest.mark.parametrize("change, message", [
    ({"canvas_width": 41}, "image 0: canvas 41 x 42; allowed: positive multiples of the patch size 14"),
    ({"canvas_width": 42 * 40}, "image 0: canvas 1680 x 42 needs a span of 43 tokens; allowed: at most"),
    ({"pixels": bytes(10)}, "image 0: 10 bytes of pixels for a 40 x 30 image on a 42 x 42 canvas; allowed:"),
    ({"width": 50, "pixels": bytes(50 * 30 * 3)}, "image 0: 4500 bytes of pixels for a 50 x 30 image on a 42 x 42"),
    ({"length": 3}, "image 0: its span has 3 tokens but its canvas needs 4; allowed:"),
])
def test_the_core_checks_each_image_against_the_model_without_decoding_it(change, message):
    [ok] = _core_images()
    assert (ok.start, ok.length, ok.image.layout.num_tokens, ok.image.width) == (1, 4, 4, 40)
    with pytest.raises(ValueError) as e:
        _core_images(**change)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_an_image_request_runs_in_the_engine_core_process():
    with LLM(MODEL, process="subprocess", runtime={"num_threads": 1}) as sub:
        assert generate(sub, [PROMPT], [images(0)])[0].token_ids == _inproc_tokens(PROMPT, images(0))


def _inproc_tokens(prompt, mm):
    with LLM(MODEL, process="inproc", runtime={"num_threads": 1}) as one:
        return generate(one, [prompt], [mm])[0].token_ids


def test_yoco_compact_and_dspark_keep_image_requests_exact(llm):
    """Past yoco.keep_tokens (140) the decoder layers replay only the last rows: compact gives mask's tokens; DSpark
    drafts after an image and greedy verification keeps the plain tokens."""
    prompt = PROMPT + list(range(30, 130)) * 2
    mm = [images(0), images(2)]
    expected = {"plain": [o.token_ids for o in generate(llm, [prompt, prompt], mm)]}
    for name, kw, same_as in (("mask", {"yoco": "mask"}, None), ("compact", {"yoco": "compact"}, "mask"),
                              ("dspark", {"decoding": "dspark"}, "plain")):
        with LLM(MODEL, process="inproc", runtime={"num_threads": 1}, **kw) as other:
            outs = generate(other, [prompt, prompt], mm)
            expected[name] = [o.token_ids for o in outs]
            if same_as is not None:
                assert expected[name] == expected[same_as], name
            if name == "dspark":
                assert all(o.num_draft_tokens > 0 for o in outs)
            if name == "compact":
                assert other.last_metrics["replay_rows_saved"] > 0


def test_the_prefix_cache_tells_images_apart_by_their_pixels():
    """Every image span holds the same placeholder ids, so the prefix cache keys a prompt with images by the spans'
    places and pixels (engine/prefix_cache.py image_root): the same image again hits, another image never does."""
    import io

    from PIL import Image, ImageOps

    buf = io.BytesIO()
    ImageOps.invert(Image.open(io.BytesIO(png(0))).convert("RGB")).save(buf, format="PNG")
    inverted = {"image_bytes": [buf.getvalue()]}  # the same size (the same span ids), other pixels
    with LLM(MODEL, process="inproc", runtime={"num_threads": 1}, cache={"block_size": 16}) as cached:
        first, again, other = (generate(cached, [LONG], [mm])[0] for mm in (images(0), images(0), inverted))
    with LLM(MODEL, process="inproc", runtime={"num_threads": 1},
             cache={"block_size": 16, "prefix_caching": False}) as plain:
        fresh = generate(plain, [LONG], [inverted])[0]
    assert len(first.prompt_token_ids) > 32  # whole blocks to share
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == 0 and other.token_ids == fresh.token_ids
