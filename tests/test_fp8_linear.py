"""FP8 projections kept as stored (Fp8BlockWeight: e4m3 + 32x32 ue8m0 block scales) compute exactly what the
dequantised projections compute on the CPU: the object dequantises to the loader's dense matrix, its row groups
to the matching rows, the torch `linear` op gives bitwise the dense result, and a model loaded (or built) with
`fp8_linears=True` gives identical logits while holding about half the projection bytes of bf16."""

from pathlib import Path

import pytest
import torch

from deepinfer.kernels.fp8_weight import Fp8BlockWeight, linear_bytes
from deepinfer.kernels.torch.linear import linear
from deepinfer.kernels.torch.quant import dequant_fp8_blocks
from deepinfer.models import ForwardBatch, load_model

FIXTURE = Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2-fp8fp4"


def _fp8(rows, cols, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=gen) * 100).to(torch.float8_e4m3fn).view(torch.uint8)
    s = torch.randint(110, 130, (-(-rows // 32), -(-cols // 32)), dtype=torch.uint8, generator=gen)
    return Fp8BlockWeight(w, s)


def test_dense_is_the_checkpoint_dequantisation_in_any_dtype():
    q = _fp8(96, 160)
    ref = dequant_fp8_blocks(q.weight.view(torch.float8_e4m3fn), q.scale)
    assert q.shape == (96, 160) and q.nbytes == 96 * 160 + 3 * 5
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(q.dense(dtype), ref.to(dtype))
    moved = q.to("cpu")
    assert torch.equal(moved.dense(torch.float32), ref)


@pytest.mark.parametrize("groups", [2, 3, 6])  # rank 48 / 32 / 16: groups starting on and inside scale blocks
def test_row_groups_are_views_with_the_rows_and_scales_of_the_whole(groups):
    q = _fp8(96, 64, seed=groups)
    full = q.dense(torch.float32)
    rank = 96 // groups
    parts = q.row_groups(groups)
    assert len(parts) == groups
    for g, part in enumerate(parts):
        assert part.shape == (rank, 64)
        assert part.weight.data_ptr() == q.weight[g * rank].data_ptr()  # a view, no copy
        assert torch.equal(part.dense(torch.float32), full[g * rank:(g + 1) * rank])


@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
def test_torch_linear_on_the_stored_weight_equals_the_dense_path_bitwise(m):
    q = _fp8(64, 96, seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    assert torch.equal(linear(x, q), linear(x, q.dense(torch.float32)))
    group = q.row_groups(2)[1]
    assert torch.equal(linear(x, group), linear(x, q.dense(torch.float32)[32:]))
    xb = x.bfloat16()
    assert torch.equal(linear(xb, q), linear(xb, q.dense(torch.bfloat16)))


@pytest.mark.parametrize("m", [1, 5, 17])
def test_fp32_output_from_bf16_operands_is_the_fp32_gemm_of_the_upcast_operands(m):
    gen = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 64, generator=gen).bfloat16(), torch.randn(40, 64, generator=gen).bfloat16()
    out = linear(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, linear(x.float(), w.float()))  # the CPU reference: what DSpark's Markov head had
    assert torch.equal(linear(x.float(), w.float(), out_dtype=torch.float32), linear(x.float(), w.float()))


def test_the_grouped_projection_is_each_group_on_its_own_slice_of_the_input():
    """grouped_linear (wo_a): group g's rows times x[:, g], concatenated; row groups keep the whole weight."""
    from deepinfer.kernels.torch.linear import grouped_linear

    q = _fp8(96, 64, seed=7)
    parts = q.row_groups(3)
    assert parts.whole is q and isinstance(parts, list)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(7))
    full = q.dense(torch.float32)
    ref = torch.cat([x[:, g] @ full[32 * g:32 * (g + 1)].T for g in range(3)], dim=-1)
    assert torch.equal(grouped_linear(x, parts), torch.cat([linear(x[:, g], parts[g]) for g in range(3)], -1))
    assert torch.allclose(grouped_linear(x, parts), ref, atol=1e-5)
    assert torch.equal(grouped_linear(x, full.view(3, 32, 64)), grouped_linear(x, parts))


def test_linear_bytes_counts_fp8_as_held_and_as_bf16():
    q = _fp8(64, 96)
    dense = torch.zeros(10, 10, dtype=torch.bfloat16)
    assert linear_bytes([q, q.row_groups(2), dense]) == (2 * q.nbytes + 200, 2 * 64 * 96 * 2 + 200)


def test_model_with_fp8_linears_gives_identical_logits_and_holds_them_as_stored():
    dense = load_model(FIXTURE, fp8_linears=False)
    stored = load_model(FIXTURE, fp8_linears=True)
    assert isinstance(dense.layers[0].attn.wq_a, torch.Tensor)
    lw = stored.layers[0]
    for w in (lw.attn.wq_a, lw.attn.wq_b, lw.attn.wkv, lw.attn.wo_b, *lw.attn.wo_a):
        assert isinstance(w, Fp8BlockWeight)
    assert len(lw.attn.wo_a) == stored.config.o_groups  # wo_a[g], as the model indexes it
    ids = [[5, 9, 13, 2, 77, 31, 8], [4, 4, 19]]
    a = dense.forward(ForwardBatch(ids, [dense.new_state(), dense.new_state()], all_logits=True))
    b = stored.forward(ForwardBatch(ids, [stored.new_state(), stored.new_state()], all_logits=True))
    assert torch.equal(a, b)


def test_loader_default_keeps_the_cpu_reference_dense():
    model = load_model(FIXTURE)
    assert isinstance(model.layers[0].attn.wq_a, torch.Tensor)


def test_synthetic_fp8_projections_hold_the_values_of_the_dense_variant():
    from deepinfer.models import synthetic
    from deepinfer.models.weights import arrange, linear_weight_bytes

    cfg = synthetic.config(dict(
        hidden_size=256, vocab_size=1024, num_attention_heads=4, head_dim=128, q_lora_rank=64, o_groups=2,
        o_lora_rank=64, n_routed_experts=8, moe_intermediate_size=64, index_n_heads=4, index_head_dim=64,
        index_topk=64, candidate_topk_blocks=16, engram_vocab_size=1000))
    stored = synthetic.random_weights(cfg, "cpu", torch.bfloat16, fp8_linears=True)
    dense = synthetic.random_weights(cfg, "cpu", torch.bfloat16, fp8_linears=False)
    fp8 = [k for k, v in stored.items() if isinstance(v, Fp8BlockWeight)]
    assert "layers.0.attn.wq_b.weight" in fp8 and not any(".experts." in k or "shared_experts" in k for k in fp8)
    for k in fp8:
        assert torch.equal(stored[k].dense(torch.bfloat16), dense[k]), k
    held, as_bf16 = linear_weight_bytes(arrange(cfg, stored, torch.bfloat16)[0])
    assert linear_weight_bytes(arrange(cfg, dense, torch.bfloat16)[0]) == (as_bf16, as_bf16)
    assert held < 0.6 * as_bf16  # 1 + 1/1024 bytes per FP8 weight instead of 2 (a few projections are bf16)
