"""Image spans in the text model (VISION_SPEC.md §6), on embedded:tiny-random-vision (tiny-random's text weights plus a
small random image path). No reference runs the multimodal forward, so the text side is held to properties:

- a text-only prompt runs exactly as on the model without an image path (bitwise);
- each span position's embedding is its image row (START, aligner rows, NEWLINEs, END), text rows untouched;
- every span position, and only those, selects its experts with ffn.gate.bias_vl;
- span positions are dead for Engram: their streams pass through unchanged, they hash as the pad id, and a text
  token's n-gram look-back stops at the span, also from a later step (the history ring);
- the image rows matter (another image changes the logits), and chunked prefill cut anywhere inside a span, or a
  batch with a text-only sequence, gives the one-shot logits bitwise.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import embedded
from deepinfer.models import ForwardBatch, SpanRows, load_model
from deepinfer.models.vision import ImageProcessor
from deepinfer.models.vision.span import expand_prompt
from vision_fixture import png

BEFORE, AFTER = [11, 12, 13], [14, 15, 16, 17]


@pytest.fixture(scope="module")
def model():
    return load_model(embedded.materialize("tiny-random-vision"))


def image_prompt(m, cases=(0,)):
    """(expanded ids, spans, per-image span rows) of BEFORE <image> ... AFTER."""
    cfg = m.vision.cfg
    ids = list(BEFORE)
    for _ in cases:
        ids += [cfg.image_token_id, 20]
    ids += AFTER
    images = ImageProcessor(cfg)([png(n) for n in cases])
    prompt = expand_prompt(ids, [im.layout for im in images], cfg.image_token_id, cfg.vocab_size)
    return prompt.input_ids.tolist(), prompt.image_spans, m.vision(images)


def span_rows_in(ids, spans, rows, lo, hi) -> SpanRows | None:
    """The SpanRows of positions [lo, hi) of a sequence."""
    offsets, parts = [], []
    for (start, n), r in zip(spans, rows):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            offsets += range(a - lo, b - lo)
            parts.append(r[a - start:b - start])
    return SpanRows(offsets, torch.cat(parts)) if parts else None


def run(m, ids, spans, rows, chunks=None, all_logits=True):
    """Logits of every prompt position, prefilled in `chunks` (one shot by default)."""
    st, out, pos = m.new_state(), [], 0
    for n in chunks or [len(ids)]:
        part = ids[pos:pos + n]
        images = [span_rows_in(ids, spans, rows, pos, pos + n)]
        out.append(m.forward(ForwardBatch([part], [st], all_logits=all_logits,
                                          images=images if images[0] is not None else None)))
        pos += n
    return torch.cat(out)


def test_text_only_prompts_are_bitwise_unchanged_by_the_image_path(model):
    text = load_model(embedded.materialize("tiny-random"))
    assert text.vision is None and model.vision is not None
    ids = BEFORE + [model.vision.cfg.image_token_id] + AFTER * 5  # the placeholder id alone is a text token
    got = []
    for m in (text, model):
        st = m.new_state()
        got.append((m.forward(ForwardBatch([ids], [st], all_logits=True)), m.forward(ForwardBatch([[7]], [st]))))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_span_positions_embed_as_their_image_rows(model, monkeypatch):
    ids, spans, rows = image_prompt(model, (0, 2))
    seen = {}
    original = model._embed
    monkeypatch.setattr(model, "_embed", lambda meta: seen.setdefault("x", original(meta)))
    run(model, ids, spans, rows)
    x = seen["x"]
    for (start, n), r in zip(spans, rows):
        assert torch.equal(x[start:start + n], r)
        assert torch.equal(r[0], model.vision.image_start) and torch.equal(r[-1], model.vision.image_end)
    text = [i for i, t in enumerate(ids) if t < model.config.vocab_size]
    assert torch.equal(x[text], model.embed[torch.tensor([ids[i] for i in text])])


def test_every_span_position_and_only_those_route_with_bias_vl(model, monkeypatch):
    ids, spans, rows = image_prompt(model, (1,))
    biases = []
    router = model.ops.moe_router
    monkeypatch.setattr(model.ops, "moe_router", lambda g, w, bias, *a: biases.append(bias) or router(g, w, bias, *a))
    run(model, ids, spans, rows)
    assert len(biases) == len(model.layers)
    span = torch.tensor([t >= model.config.vocab_size for t in ids])
    assert int(span.sum()) == sum(n for _, n in spans)
    for lw, bias in zip(model.layers, biases):
        assert torch.equal(bias[span], lw.ffn.gate.bias_vl.expand(int(span.sum()), -1))
        assert torch.equal(bias[~span], lw.ffn.gate.bias.expand(int((~span).sum()), -1))


def test_span_positions_are_dead_for_engram(model, monkeypatch):
    """Span rows pass through the Engram gate unchanged and hash only the pad id; the text token k positions after
    the span reads the pad id from look-back shift k on (the span and all before it), in one step or the next."""
    ids, spans, rows = image_prompt(model, (2,))
    start, n = spans[0]
    end = start + n
    pad = model.engram.pad_id
    looks, gates = [], []
    hash_op, engram = model.ops.engram_hash, model._engram
    monkeypatch.setattr(model.ops, "engram_hash", lambda look, *a: looks.append(look) or hash_op(look, *a))
    monkeypatch.setattr(model, "_engram",
                        lambda s, e, h, img=None, *rest: gates.append((s, engram(s, e, h, img, *rest))) or gates[-1][1])
    for chunks in (None, [end, len(ids) - end]):  # the text after the span in the same step, then in the next
        looks.clear(), gates.clear()
        run(model, ids, spans, rows, chunks)
        look = torch.cat(looks)
        assert (look[start:end] == pad).all()
        for k in (1, 2):
            assert look[end - 1 + k, k:].eq(pad).all() and look[end - 1 + k, :k].ne(pad).all()
        assert look[start - 1].ne(pad).all()  # text before the span looks back as before
        streams_in, streams_out = gates[0]
        assert torch.equal(streams_out[start:end], streams_in[start:end])
        assert not torch.equal(streams_out[:start], streams_in[:start])


def test_the_image_rows_decide_the_output(model):
    ids, spans, rows = image_prompt(model, (0,))
    again = image_prompt(model, (0,))[2]
    other = [torch.randn_like(r) for r in rows]
    base = run(model, ids, spans, rows)
    assert torch.equal(base, run(model, ids, spans, again))
    changed = run(model, ids, spans, other)
    start = spans[0][0]
    assert torch.equal(changed[:start], base[:start])  # causal: nothing before the span moves
    assert not torch.allclose(changed[start:], base[start:])


@pytest.mark.parametrize("chunks", [(5,), (4, 1), (7, 3, 2), (1,)])
def test_chunked_prefill_cut_inside_spans_matches_one_shot(model, chunks):
    ids, spans, rows = image_prompt(model, (0, 2))
    sizes, left = [], len(ids)
    while left:
        for c in chunks:
            take = min(c, left)
            if take:
                sizes.append(take)
                left -= take
    assert any(start < sum(sizes[:i]) < start + n for (start, n) in spans for i in range(1, len(sizes)))
    assert torch.equal(run(model, ids, spans, rows, sizes), run(model, ids, spans, rows))


def test_an_image_sequence_batched_with_a_text_sequence_matches_each_alone(model):
    ids, spans, rows = image_prompt(model, (1,))
    text = BEFORE + AFTER * 3
    alone_image = run(model, ids, spans, rows, all_logits=False)
    st = model.new_state()
    alone_text = model.forward(ForwardBatch([text], [st]))
    both = model.forward(ForwardBatch([ids, text], [model.new_state(), model.new_state()],
                                      images=[span_rows_in(ids, spans, rows, 0, len(ids)), None]))
    assert torch.equal(both[0], alone_image[0]) and torch.equal(both[1], alone_text[0])


def test_span_ids_without_rows_are_refused_in_one_line(model):
    ids, spans, rows = image_prompt(model, (0,))
    with pytest.raises(ValueError, match=r"^ForwardBatch: image-span tokens at new-token offsets \[3, 4"):
        model.forward(ForwardBatch([ids], [model.new_state()], images=[None]))
