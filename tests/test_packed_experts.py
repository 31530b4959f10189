"""Experts kept in the checkpoint's FP4/FP8 format (PackedExperts, how the model holds them on a GPU) compute
exactly what the dequantised experts compute: the layout round-trips, and the model's logits do not change."""

from pathlib import Path

import torch

from deepinfer.kernels.packed_experts import PackedExperts, QuantizedWeight, can_pack, pack_quantized
from deepinfer.models import ForwardBatch, load_model

FIXTURE = Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2-fp8fp4"


def _fp4(rows, cols, gen):
    w = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(118, 130, (rows, cols // 32), dtype=torch.uint8, generator=gen)
    return QuantizedWeight("fp4", w, s, (rows, cols))


def _fp8(rows, cols, gen):
    w = (torch.randn(rows, cols, generator=gen) * 100).to(torch.float8_e4m3fn).view(torch.uint8)
    s = torch.randint(110, 130, (rows // 32, cols // 32), dtype=torch.uint8, generator=gen)
    return QuantizedWeight("fp8", w, s, (rows, cols))


def test_packed_layout_round_trips_every_expert_exactly():
    gen = torch.Generator().manual_seed(0)
    for make in (_fp4, _fp8):
        experts = [(make(128, 64, gen), make(64, 128, gen), make(128, 64, gen)) for _ in range(3)]
        packed = pack_quantized(experts)
        assert (packed.n_experts, packed.inter, packed.hidden) == (3, 128, 64)
        for e, (w1, w2, w3) in enumerate(experts):
            got = packed.dense(e, torch.float32)
            for g, q in zip(got, (w1, w2, w3)):
                assert torch.equal(g, q.dense(torch.float32))


def test_only_whole_half_tiles_pack():
    assert can_pack("fp4", 2304, 5120) and can_pack("fp8", 32, 64)
    assert not can_pack("fp4", 48, 64) and not can_pack("float", 64, 64)


def test_model_with_packed_experts_gives_identical_logits():
    dense = load_model(FIXTURE, packed_experts=False)
    packed = load_model(FIXTURE, packed_experts=True)
    assert isinstance(packed.layers[0].ffn.experts, PackedExperts)
    assert isinstance(packed.layers[0].ffn.shared_experts, PackedExperts)
    assert isinstance(dense.layers[0].ffn.experts, list)
    ids = [[5, 9, 13, 2, 77, 31, 8], [4, 4, 19]]
    a = dense.forward(ForwardBatch(ids, [dense.new_state(), dense.new_state()], all_logits=True))
    b = packed.forward(ForwardBatch(ids, [packed.new_state(), packed.new_state()], all_logits=True))
    assert torch.equal(a, b)
