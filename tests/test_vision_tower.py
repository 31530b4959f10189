"""The ViT, the 3x3 unshuffle, the aligner and the span rows against the golden fixture tiny-vit2 (VISION_SPEC.md
§4-§6.2), in float32, each stage fed the fixture's stored input: within atol 1e-5 (the spread the fixture measured
between three implementations and float64 is <= 3e-6); the gathers and the delimiter rows exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.models.loading.errors import CheckpointError
from deepinfer.models.vision import ImageProcessor, VisionConfig, VisionConfigError, plan_image
from deepinfer.models.vision.aligner import unshuffle
from deepinfer.models.vision.loading import load_vision_model
from deepinfer.models.vision.model import VisionModel
from deepinfer.models.vision.span import span_rows
from vision_fixture import CASES, VISION_FIXTURE, case, geometry, png

ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return load_vision_model(VISION_FIXTURE)


def _layout(n):
    return plan_image(geometry(n)["width"], geometry(n)["height"], VisionConfig.from_file(VISION_FIXTURE))


def _features(model, cases):
    return model.vision(torch.cat([case(n, "pixel_values") for n in cases]),
                        torch.cat([case(n, "images_global_attn_pos_id") for n in cases]),
                        [case(n, "pixel_values").shape[0] for n in cases])


def test_weights_load_as_stored_bf16_upcast_exactly(model):
    stored = load_file(str(VISION_FIXTURE / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(params) == set(stored)
    for name, t in stored.items():
        assert t.dtype == torch.bfloat16 and params[name].dtype == torch.float32
        assert torch.equal(params[name], t.float()), name


@pytest.mark.parametrize("n", CASES)
def test_vit_features(model, n):
    with torch.inference_mode():
        got = _features(model, [n])
    torch.testing.assert_close(got, case(n, "vision_features"), atol=ATOL, rtol=0)


def test_images_batch_without_attending_across_each_other(model):
    """case0 and case2 in one varlen call equal each run alone: attention stays within each image."""
    with torch.inference_mode():
        together = _features(model, [0, 2])
        alone = torch.cat([_features(model, [0]), _features(model, [2])])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(together, torch.cat([case(0, "vision_features"), case(2, "vision_features")]),
                               atol=ATOL, rtol=0)


def test_vision_attention_attends_within_each_image_only():
    """The op kind `vision_attention` (torch: one SDPA per image, no padding, no mask) against a float64 softmax per
    image; each image's rows are bitwise the same run alone. No TileLang kernel: on sm90 it is a torch fallback."""
    from deepinfer.kernels.registry import backends_for
    from deepinfer.kernels.torch.vision import vision_attention

    gen = torch.Generator().manual_seed(0)
    cu = [0, 5, 17, 18]
    q, k, v = (torch.randn(cu[-1], 4, 16, generator=gen) for _ in range(3))
    out = vision_attention(q, k, v, cu)
    for s, e in zip(cu[:-1], cu[1:]):
        qi, ki, vi = (t[s:e].double().transpose(0, 1) for t in (q, k, v))
        ref = torch.softmax(qi @ ki.transpose(1, 2) / 4.0, dim=-1) @ vi
        torch.testing.assert_close(out[s:e], ref.transpose(0, 1).float(), atol=1e-6, rtol=0)
        assert torch.equal(vision_attention(q[s:e], k[s:e], v[s:e], [0, e - s]), out[s:e])
    assert backends_for("vision_attention", "cpu") == ["torch"]
    assert backends_for("vision_attention", "cuda") == ["torch"]


def test_the_tower_calls_its_norms_and_attention_through_the_ops(model):
    """use_ops hands the tower an OpSet: every block's two norms and attention, and the final norm, are its calls."""
    from deepinfer.models.vision.tower import torch_ops

    calls = []
    ops = torch_ops()
    spy = type("Spy", (), {k: staticmethod(lambda *a, _k=k, _f=getattr(ops, k): calls.append(_k) or _f(*a))
                           for k in ("rms_norm", "vision_attention")})
    model.use_ops(spy)
    try:
        with torch.inference_mode():
            got = _features(model, [0, 2])
    finally:
        model.use_ops(ops)
    layers = model.cfg.num_hidden_layers
    assert calls.count("vision_attention") == layers and calls.count("rms_norm") == 2 * layers + 1
    torch.testing.assert_close(got, torch.cat([case(0, "vision_features"), case(2, "vision_features")]),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", CASES)
def test_unshuffle_is_the_stored_gather(n):
    """3x3 windows, zero-padded at the ragged bottom/right edges, column c*9 + 3i + j: a gather, so exact."""
    g = geometry(n)
    got = unshuffle(case(n, "vision_features"), g["n_vit_h"], g["n_vit_w"], 3)
    assert torch.equal(got, case(n, "aligner_input"))


@pytest.mark.parametrize("n", CASES)
def test_aligner(model, n):
    with torch.inference_mode():
        got = model.aligner(case(n, "aligner_input"))
    torch.testing.assert_close(got, case(n, "image_embeds"), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", CASES)
def test_span_rows_put_start_newlines_and_end_around_the_grid(model, n):
    g, want = geometry(n), case(n, "span_embeds")
    layout = _layout(n)
    rows = span_rows(case(n, "image_embeds"), layout, model.image_start, model.image_newline, model.image_end)
    assert rows.shape == want.shape == (g["num_tokens"], 64)
    torch.testing.assert_close(rows, want, atol=0, rtol=0)  # fed the stored rows, the layout is a copy
    w = g["n_llm_w"]
    assert torch.equal(rows[0], model.image_start.detach()) and torch.equal(rows[-1], model.image_end.detach())
    for row in range(g["n_llm_h"]):
        assert torch.equal(rows[1 + row * (w + 1) + w], model.image_newline.detach())


def test_png_to_span_rows_end_to_end(model):
    """The whole CPU path on all three cases at once: bytes -> processor -> ViT (one varlen batch) -> aligner ->
    span rows."""
    processed = ImageProcessor(model.cfg)([png(n) for n in CASES])
    for n, rows in zip(CASES, model(processed)):
        torch.testing.assert_close(rows, case(n, "span_embeds"), atol=ATOL, rtol=0)


def test_checkpoint_errors_are_one_line(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(VISION_FIXTURE, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["vision.norm.weight"]
    tensors["aligner.w2.bias"] = torch.zeros(3, dtype=torch.bfloat16)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"aligner.w2.bias is torch.bfloat16 \[3\]; allowed: \[64\]"):
        load_vision_model(broken)
    tensors["aligner.w2.bias"] = torch.zeros(64, dtype=torch.bfloat16)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks 1 image-path tensors \\(vision.norm.weight\\)"):
        load_vision_model(broken)
    text_only = tmp_path / "text"
    text_only.mkdir()
    cfg = json.loads((VISION_FIXTURE / "config.json").read_text())
    del cfg["vision_config"]
    (text_only / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VisionConfigError, match="no vision_config"):
        load_vision_model(text_only)


def test_released_structure_has_the_checkpoint_shapes_and_size():
    """The released vision_config builds the tensors of VISION_SPEC.md §7: 411,842,560 ViT and 73,410,560 aligner
    parameters plus three [5120] span vectors (built on the meta device: nothing is allocated)."""
    from test_vision_processor import released

    with torch.device("meta"):
        model = VisionModel(released())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["vision.patch_embed.proj.weight"] == (1024, 588)
    assert shapes["vision.blocks.31.attn.wqkv.weight"] == (3072, 1024)
    assert shapes["vision.blocks.31.mlp.w1.weight"] == (5632, 1024)
    assert shapes["vision.blocks.31.mlp.w2.weight"] == (1024, 2816)
    assert shapes["aligner.w1.weight"] == (5120, 9216) and shapes["image_newline"] == (5120,)
    count = lambda prefix: sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))  # noqa: E731
    assert (count("vision."), count("aligner."), count("image_")) == (411_842_560, 73_410_560, 3 * 5120)


def test_bf16_weights_run_close_to_the_float32_reference():
    """The same path in bfloat16 (the real dtype; the GPU path will follow DeepInfer's bf16 rounding points): only
    the structure is checked here, to bf16 accuracy."""
    model = load_vision_model(VISION_FIXTURE, dtype=torch.bfloat16)
    processed = ImageProcessor(model.cfg)([png(0)])
    [rows] = model(processed)
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows.float(), case(0, "span_embeds"), atol=0.05, rtol=0.02)  # measured: 1.6e-2
