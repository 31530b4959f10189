"""benchmarks/routing_spread.py: the distinct routed experts of a decode step, counted from the model's own router
calls, and the step floor with those counts in place of roofline.py's uniform ones."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import routing_spread  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from deepinfer.embedded import materialize
    from deepinfer.models import load_model

    return load_model(materialize("tiny-random"), device="cpu", dtype=torch.float32)


def test_one_row_touches_exactly_its_top_k_and_a_batch_at_most_every_expert(tiny):
    cfg = tiny.config
    one = routing_spread.routed_experts(tiny, 1, context=9)
    assert one == [cfg.num_experts_per_tok] * len(one) and len(one) >= 1
    four = routing_spread.routed_experts(tiny, 4, context=9)
    assert len(four) == len(one)  # one count per MoE layer of the step
    assert all(cfg.num_experts_per_tok <= n <= min(4 * cfg.num_experts_per_tok, cfg.n_routed_experts) for n in four)
    assert max(four) > cfg.num_experts_per_tok  # four random prompts do not all pick the same experts


def test_the_router_is_restored_after_recording(tiny):
    with routing_spread.recording_router(tiny) as calls:
        assert "moe_router" in vars(tiny.ops)
    assert "moe_router" not in vars(tiny.ops) and calls == []


def test_the_routed_floor_takes_off_only_the_experts_not_touched():
    c = dict(n_routed_experts=384, num_experts_per_tok=6, hidden_size=4096, moe_intermediate_size=2048)
    roof = dict(bytes=10e9, compute_ms=0.5)
    uni = routing_spread.uniform_experts(c, 64)
    assert uni == pytest.approx(243.8, abs=0.1)  # roofline.py's count
    same = routing_spread.routed_floor(c, roof, 1e12, 64, [round(uni)] * 2)
    assert same["bytes"] == pytest.approx(10e9, rel=1e-3)
    fewer = routing_spread.routed_floor(c, roof, 1e12, 64, [144, 144])
    per_expert = 3 * 4096 * 2048 * (0.5 + 1 / 32)
    assert fewer["bytes"] == pytest.approx(10e9 - 2 * (uni - 144) * per_expert)
    assert fewer["floor_ms"] == pytest.approx(fewer["bytes"] / 1e12 * 1e3)
    assert fewer["experts_measured"] == 144 and fewer["moe_calls"] == 2
    compute_bound = routing_spread.routed_floor(c, dict(roof, compute_ms=1e3), 1e12, 64, [144, 144])
    assert compute_bound["floor_ms"] == 1e3


@pytest.fixture(scope="module")
def wide_router():
    """The embedded architecture with V4.1-Flash's router (384 experts, top-6), random weights: the synthetic
    benchmark models' routing at a width the CPU runs in seconds."""
    from deepinfer.models import synthetic
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.tiny import TEXT_CONFIG

    cfg = ModelConfig.from_dict({**TEXT_CONFIG, "num_hidden_layers": 2, "compress_ratios": [0, 0],
                                 "kv_source_layer_ids": [], "index_source_layer_ids": [], "engram_layer_ids": [],
                                 "candidate_source_layer_id": -1, "n_routed_experts": 384, "num_experts_per_tok": 6,
                                 "moe_intermediate_size": 32, "num_nextn_predict_layers": 0})
    return synthetic.build_model(cfg, "cpu", torch.float32, backends=["torch"])


def test_random_weights_route_as_evenly_as_the_roofline_counts(wide_router):
    """roofline.py's floor counts the distinct experts of even routing (244 of 384 for 64 tokens): the benchmark
    models' routers, their selection bias zero, touch about that many; the fixtures' random N(0, 0.2) bias instead
    favours some experts in every token's choice and a step touches far fewer (the overstated % it caused)."""
    c = dict(n_routed_experts=384, num_experts_per_tok=6)
    uni = routing_spread.uniform_experts(c, 64)
    even = routing_spread.routed_experts(wide_router, 64, context=8)
    assert all(torch.equal(lw.ffn.gate.bias, torch.zeros_like(lw.ffn.gate.bias)) for lw in wide_router.layers)
    assert sum(even) / len(even) > 0.85 * uni  # 225 of 244 at this width (hidden 128: some correlation)
    g = torch.Generator().manual_seed(0)
    for lw in wide_router.layers:
        lw.ffn.gate.bias.copy_(torch.randn(lw.ffn.gate.bias.shape, generator=g) * 0.2)
    try:
        skewed = routing_spread.routed_experts(wide_router, 64, context=8)
    finally:
        for lw in wide_router.layers:
            lw.ffn.gate.bias.zero_()
    assert sum(skewed) / len(skewed) < 0.7 * uni  # 136


def test_the_json_carries_the_even_routing_target_for_the_models_as_built():
    """One target per batch, from the rows with the bias as the benchmark models have it (zero): distinct experts
    over roofline.py's uniform count, at least 0.9; the drawn-bias rows are the comparison, not a target."""
    rows = [dict(bias="zero", batch=64, mean=241.5, uniform=243.8), dict(bias="drawn", batch=64, mean=142.7,
                                                                          uniform=243.8),
            dict(bias="zero", batch=8, mean=30.0, uniform=45.5)]
    got = routing_spread.targets(rows)
    assert [(t["measured"], t["target"], t["unit"], t["met"]) for t in got] == [
        (0.991, 0.9, "x uniform", True), (0.659, 0.9, "x uniform", False)]
    assert "B=64" in got[0]["name"] and "B=8" in got[1]["name"]
