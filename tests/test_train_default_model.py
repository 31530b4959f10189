"""tools/train_default_model.py: the CPU smoke run (loss falls, the export loads, the engine runs exactly the model
that was trained) and the training-form ops against the inference ops they stand in for."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import train_default_model  # noqa: E402
from v41_train import data, evaluate, ops  # noqa: E402
from v41_train.draft import DraftModel, draft_loss  # noqa: E402
from v41_train.model import TrainModel  # noqa: E402
from v41_train.stored import fq_fp4, fq_fp8, quantized_weight, storage_kind, stored_value, stored_values  # noqa: E402

from deepinfer.embedded import release_tensors  # noqa: E402
from deepinfer.kernels.torch.attention import sink_attention  # noqa: E402
from deepinfer.kernels.torch.indexer import indexer_scores  # noqa: E402
from deepinfer.kernels.torch.quant import dequant_fp4_rows, dequant_fp8_blocks, fake_quant_fp4, fake_quant_fp8  # noqa: E402
from deepinfer.models import load_model  # noqa: E402
from deepinfer.models.config import ModelConfig  # noqa: E402
from deepinfer.models.loading import tensors as kinds  # noqa: E402

# The training forward and the engine's model on the exported checkpoint compute the same function up to fp32
# rounding (measured: <= 5e-6 on logits of magnitude ~7). A rounding difference can flip one FP8/FP4 fake-quant
# bucket downstream (MODEL_V41_SPEC.md §10.4), so the bound leaves room for that: 1e-3 absolute.
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("smoke")
    report = train_default_model.main(["--smoke", "--out", str(out)])  # asserts the loss falls
    return out, report


@pytest.mark.timeout(180)
def test_smoke_loss_falls_and_the_engine_completes_prompts(smoke):
    _, report = smoke
    assert sum(report["last_losses"]) / 5 < sum(report["first_losses"]) / 5 - 0.5
    assert report["heldout_loss"] < report["unigram_loss"] + 0.5  # not yet better than unigram after 30 steps
    assert all(isinstance(t, str) and t for t in report["completions"].values())


@pytest.mark.timeout(180)
def test_export_loads_and_the_engine_computes_the_trained_logits(smoke):
    out, report = smoke
    agreement = report["logits_vs_engine"]
    assert agreement["max_abs_logit_diff"] <= LOGIT_TOL, agreement
    assert agreement["argmax_agreement"] == 1.0, agreement
    model = load_model(out)
    assert model.config.vocab_size == model.tokenizer.get_vocab_size(with_added_tokens=True)
    assert json.loads((out / "report.json").read_text())["preset"] == "smoke"


@pytest.mark.timeout(60)
def test_export_is_in_the_released_storage_format(smoke):
    out, _ = smoke
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["layers.2.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.2.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.experts.1.w1.weight"] == "I8" and dtypes["layers.0.ffn.experts.1.w1.scale"] == "F8_E8M0"
    assert dtypes["layers.1.engram.embed.weight"] == "F8_E4M3"
    assert dtypes["layers.0.hc_attn_fn"] == "F32" and dtypes["layers.0.ffn.gate.bias"] == "F32"
    assert dtypes["embed.weight"] == "BF16"
    assert dtypes["mtp.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["mtp.2.ffn.experts.7.w1.weight"] == "I8"
    assert dtypes["mtp.0.main_proj.weight"] == "F8_E4M3" and "mtp.2.confidence_head.proj.weight" in dtypes


@pytest.mark.timeout(60)
def test_the_engine_drafts_exactly_what_the_draft_layers_were_trained_as(smoke):
    """DSpark in the engine (models/dspark.py, reading its context rings) vs the training drafter (draft.py, dense)
    on the exported checkpoint, with every draft forced to the text's token: the same logits and confidences."""
    _, report = smoke
    vs = report["drafting"]["vs_engine"]
    assert vs["max_abs_logit_diff"] <= LOGIT_TOL and vs["max_abs_confidence_diff"] <= 1e-4, vs
    assert vs["argmax_agreement"] == 1.0, vs
    assert len(report["draft_last_losses"]) == 5 and report["drafting"]["blocks"] > 0


@pytest.mark.timeout(60)
def test_every_draft_tensor_gets_a_gradient(smoke):
    out, _ = smoke
    cfg = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    backbone, drafter = TrainModel(cfg, tok, seed=0), DraftModel(cfg, seed=0)
    ids = torch.randint(3, 300, (2, 41), generator=torch.Generator().manual_seed(0))
    targets = drafter.cfg.dspark_target_layer_ids
    with torch.no_grad():
        w = backbone.weights()
        feats = backbone(ids[:, :40], features_at=targets).features
    res = drafter(ids, [feats[t] for t in targets], torch.tensor([[0, 17, 33], [5, 20, 34]]), w["embed.weight"],
                  w["head.weight"])
    # block position i of anchor a guesses the token at a + 2 + i
    assert res.targets[0, 0] == ids[0, 2] and res.targets[5, 4] == ids[1, 34 + 2 + 4]
    loss, conf, _ = draft_loss(res)
    (loss + conf).backward()
    dead = [n for n, p in drafter.params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    assert all("/experts/" in n for n in dead), dead


@pytest.mark.timeout(60)
def test_tokenizer_has_the_chat_markers_where_the_package_tokenizer_has_them(smoke):
    import deepseek_recipe as dr

    out, _ = smoke
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    chat = data.chat_tokens()
    bpe = tok.get_vocab_size(with_added_tokens=True) - len(chat)
    assert [tok.token_to_id(s) for s in (data.BOS, data.EOS, data.PAD)] == [0, 1, 2]
    assert [tok.token_to_id(s) for s in chat] == list(range(bpe, bpe + len(chat)))
    enc = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(str(out / "tokenizer.json")))
    ids = enc.encode(dr.Conversation([dr.UserMessage("def f(x):")], thinking_mode=True))
    for marker in ("<｜User｜>", "<｜Assistant｜>", "<think>"):
        assert tok.token_to_id(marker) in ids
    assert tok.encode("x").ids[0] == 0  # BOS first, as the engine's prompts


@pytest.mark.timeout(60)
def test_training_is_deterministic_given_the_seed(smoke):
    out, _ = smoke
    cfg = json.loads((out / "config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        model = TrainModel(cfg, tok, seed=7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            out_ = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(out_.logits.flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            (loss + out_.indexer_kl).backward()
            opt.step()
            model.update_router_bias(out_.expert_counts, 1e-3)
        losses.append(loss.item())
    assert losses[0] == losses[1]


@pytest.mark.timeout(60)
def test_every_trainable_tensor_gets_a_gradient_and_features_come_back(smoke):
    out, _ = smoke
    cfg = json.loads((out / "config.json").read_text())
    model = TrainModel(cfg, Tokenizer.from_file(str(out / "tokenizer.json")), seed=0)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    res = model(ids, features_at=(5, 6))
    (res.logits.logsumexp(-1).mean() + res.indexer_kl).backward()
    dead = [n for n, p in model.params.items() if p.grad is None or not p.grad.abs().sum() > 0]
    # an expert no token chose this batch is the only allowed exception
    assert all("/experts/" in n for n in dead), dead
    assert res.indexer_kl > 0 and set(res.features) == {5, 6}
    assert res.features[5].shape == (2, 40, ModelConfig.from_dict(cfg).hidden_size)


# ---- the training-form ops against the inference ops ------------------------------------------------------
@pytest.mark.timeout(30)
def test_dense_sink_attention_equals_the_slate_op_in_float64():
    g = torch.Generator().manual_seed(0)
    B, T, H, D, S = 2, 9, 3, 16, 13
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    keys = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, S, generator=g) < 0.5
    mask[0, 3] = False  # a query that sees nothing: zero output
    sink = torch.randn(H, generator=g, dtype=torch.float64)
    dense = ops.sink_attention_dense(q, keys, mask, sink, 0.25)
    for b in range(B):
        for t in range(T):  # the inference op over this query's slate: only the keys it may see, in order
            slate = keys[b, mask[b, t]][None]
            bias = torch.zeros(1, slate.shape[1], dtype=torch.float64)
            ref = sink_attention(q[b, t][None], slate, bias, sink, 0.25)[0]
            torch.testing.assert_close(dense[b, t], ref, rtol=0, atol=1e-12)
    assert dense[0, 3].abs().max() == 0


@pytest.mark.timeout(30)
def test_dense_indexer_scores_equal_the_inference_scores():
    g = torch.Generator().manual_seed(1)
    B, T, h, d, G = 2, 7, 4, 64, 5
    iq = fake_quant_fp4(torch.randn(B, T, h, d, generator=g), 32)  # FP4 inputs, as in the model
    ik = fake_quant_fp4(torch.randn(B, G, d, generator=g), 32)
    w = torch.randn(B, T, h, generator=g)
    dense = ops.indexer_scores_dense(iq.double(), ik.double(), w.double(), d**-0.5)
    ref = indexer_scores(iq.reshape(B * T, h, d), ik, torch.arange(B).repeat_interleave(T), w.reshape(B * T, h),
                         d**-0.5)
    torch.testing.assert_close(dense.reshape(B * T, G), ref.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(30)
def test_window_and_entry_visibility_follow_the_spec():
    m = ops.window_mask(6, 3, "cpu")
    assert m[5].tolist() == [False, False, False, True, True, True] and m[0].tolist() == [True] + [False] * 5
    count, vis = ops.entry_visibility(6, 2, "cpu")
    assert count.tolist() == [0, 1, 1, 2, 2, 3]  # entry g visible once token 2g+1 has passed
    assert vis.shape == (6, 3) and vis[2].tolist() == [True, False, False]


@pytest.mark.timeout(30)
def test_indexer_kl_is_zero_at_the_target_and_finite_for_queries_that_see_nothing():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 3, 4, 5, generator=g)
    _, visible = ops.entry_visibility(4, 1, "cpu")
    visible = torch.cat([visible, torch.zeros(4, 1, dtype=torch.bool)], 1)
    visible[0] = False  # the first query sees nothing
    target = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1).mean(1).nan_to_num(0.0)
    scores = target.clamp_min(1e-30).log().requires_grad_()  # the indexer at the optimum (finite everywhere)
    kl = ops.indexer_kl(scores, logits, visible)
    kl.backward()
    assert abs(kl.item()) < 1e-6 and torch.isfinite(scores.grad).all()


@pytest.mark.timeout(30)
def test_straight_through_quantisers_forward_the_inference_values_and_pass_gradients():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g, requires_grad=True)
    for fq, ref in ((fq_fp8(x), fake_quant_fp8(x.detach())), (fq_fp4(x, 16, True), fake_quant_fp4(x.detach(), 16, True)),
                    (fq_fp4(x, 32, False), fake_quant_fp4(x.detach(), 32, False))):
        assert torch.equal(fq, ref)
        (gx,) = torch.autograd.grad(fq.sum(), x)
        assert torch.equal(gx, torch.ones_like(x))


@pytest.mark.timeout(30)
def test_quantised_weights_are_what_the_writer_and_loader_produce():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=g) * 0.1
    cases = {"layers.0.attn.wq_a.weight": kinds.Spec((64, 96), kinds.LINEAR),
             "layers.0.ffn.experts.0.w1.weight": kinds.Spec((64, 96), kinds.EXPERT)}
    for name, spec in cases.items():
        stored = release_tensors_single(name, spec, w)
        assert torch.equal(stored_value(name, spec, w), stored)
        wp = w.clone().requires_grad_()
        (gw,) = torch.autograd.grad(quantized_weight(name, spec, wp).sum(), wp)
        assert torch.equal(gw, torch.ones_like(w))
    # the batched form the training step uses: the same values, also where 32x32 blocks need padding
    for name, spec, shape in (("layers.0.attn.wq_a.weight", kinds.Spec((40, 72), kinds.LINEAR), (40, 72)),
                              ("layers.0.ffn.experts.0.w1.weight", kinds.Spec((64, 96), kinds.EXPERT), (64, 96)),
                              ("layers.1.engram.embed.weight", kinds.Spec((64, 96), kinds.TABLE), (64, 96)),
                              ("norm.weight", kinds.Spec((96,)), (1, 96))):
        stack = torch.randn(3, *shape, generator=g) * 0.1
        stack[1, :8] = 0  # all-zero blocks get scale 1
        batched = stored_values(storage_kind(name, spec), stack)
        for i in range(3):
            assert torch.equal(batched[i], stored_value(name, spec, stack[i].view(spec.shape)).view(shape))
    bf16 = stored_value("norm.weight", kinds.Spec((96,)), w[0])
    assert torch.equal(bf16, w[0].to(torch.bfloat16).float())
    assert torch.equal(stored_value("layers.0.hc_attn_fn", kinds.Spec((64, 96)), w), w)  # F32 as released


def release_tensors_single(name, spec, w):
    """What embedded's writer stores for one tensor, read back the way the loader dequantises it."""
    from deepinfer.embedded import quantize_fp4_rows, quantize_fp8_blocks

    if kinds.FP4_ROWS in spec.allowed:
        return dequant_fp4_rows(*quantize_fp4_rows(w))
    return dequant_fp8_blocks(*quantize_fp8_blocks(w))


@pytest.mark.timeout(30)
def test_release_tensors_rejects_missing_and_unexpected_names(smoke):
    out, _ = smoke
    cfg = json.loads((out / "config.json").read_text())
    with pytest.raises(ValueError, match="missing"):
        release_tensors(cfg, {"embed.weight": torch.zeros(1)})


@pytest.mark.timeout(30)
def test_plausibility_measure():
    assert evaluate.plausible("def f(x):", "\n    return x + 1\n", False)
    assert evaluate.plausible("def f(x):", "\n    y = g(x,\n          3", True)  # cut line dropped, ( closed
    assert evaluate.plausible("def f(x):", "\n    for i in x:\n", False)  # open block gets a pass
    assert evaluate.plausible("def f(x):", '\n    """Doc\n    more', True)  # open docstring closed
    assert evaluate.plausible("def f(x):", "  # why\n    return 1\n", False)  # the header line continued
    assert not evaluate.plausible("def f(x):", "\n    return x +\n", False)
    assert not evaluate.plausible("def f(x):", "", False)  # no body
    assert not evaluate.plausible("def f(x):", "\n    return", True)  # the only body line was cut
    assert not evaluate.plausible("def f(x):", "\n  return 1\n return 2\n", False)