"""tools/parallel_memory.py: the full-size V4.1-Flash bytes against hand counts from MODEL_V41_SPEC.md §8."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import parallel_memory as pm  # noqa: E402


@pytest.fixture(scope="module")
def flash():
    cfg = pm.ModelConfig.from_dict(pm.FLASH_CONFIG)
    return cfg, pm.weight_groups(cfg)


def test_released_config_and_parameter_count(flash):
    cfg, _ = flash
    assert (cfg.num_hidden_layers, cfg.num_nextn_predict_layers, cfg.n_routed_experts) == (40, 3, 384)
    specs = pm.kinds.expected_tensors(cfg, draft_layers=True)
    params = sum(math.prod(s.shape) for s in specs.values() if not s.optional)
    assert params == pytest.approx(763e9, rel=2e-3)  # §8.2 "Total ≈ 763 B parameters"


def test_stored_bytes_by_hand(flash):
    cfg, groups = flash
    fp4 = 2304 * 5120 // 2 + 2304 * 160  # w1 / w3 / w2: e2m1 pairs + one ue8m0 per row and 32 inputs
    assert groups["experts"] == 40 * 384 * 3 * fp4
    assert groups["dspark_experts"] == 3 * 128 * 3 * fp4
    assert groups["engram_tables"] == (384006168 + 384016682) * (256 + 8)
    assert groups["engram_device"] == (384006168 + 384016682) * 256 * 2  # loaded onto a GPU: bf16
    wq_b = pm.kinds.Spec((32768, 1280), pm.kinds.LINEAR)
    assert pm.stored_bytes("layers.0.attn.wq_b.weight", wq_b) == 32768 * 1280 + 1024 * 40
    assert pm.stored_bytes("layers.0.hc_attn_fn", pm.kinds.Spec((24, 20480))) == 24 * 20480 * 4  # F32
    assert pm.stored_bytes("embed.weight", pm.kinds.Spec((129280, 5120))) == 129280 * 5120 * 2  # BF16
    assert 9e9 < groups["replicated"] < 12e9


def test_expert_parallel_split(flash):
    cfg, groups = flash
    r = pm.per_rank(cfg, groups, 8, 32)
    assert (r["slots"], r["d_slots"]) == (52, 128)  # (384 + 32) / 8; the draft layers' experts on every rank
    assert r["experts"] == pytest.approx(groups["experts"] * 52 / 384 + groups["dspark_experts"])
    assert pm.per_rank(cfg, groups, 1, 32)["slots"] == 384  # no redundant experts on one rank
    assert pm.per_rank(cfg, groups, 8, 1)["slots"] == 49  # 1 redundant rounded up to 8


def test_sequences_fit(flash):
    cfg, _ = flash
    layout = pm.CacheLayout(cfg, pm.torch.bfloat16, block_size=64, max_rollback=pm.ROLLBACK, draft_layers=3)
    assert layout.bytes_per_token() == 890  # §5.2: 720 B compressed KV + 170 B indexer keys
    per_seq = layout.slot_bytes() + 32768 // 64 * layout.block_bytes()
    assert pm.sequences(10 * per_seq, layout, 32768) == 10
    assert pm.sequences(10 * per_seq - 1, layout, 32768) == 9


def test_ep_buffers_are_the_engines_static_buffers(flash):
    """The column is what StaticBuffers.allocate takes: 3 row buffers + 2 metadata of world x capacity rows."""
    from deepinfer.distributed.ep_dispatch import StaticBuffers

    cfg, groups = flash
    assert pm.ep_buffer_bytes(cfg, 1, 384, 256, 5) == 0
    small = pm.ModelConfig.from_dict({**pm.FLASH_CONFIG, "text_config": {**pm.FLASH_CONFIG["text_config"],
                                                                        "hidden_size": 64}})
    b = StaticBuffers.allocate(4 * 6, 6, 48, 8, 64, pm.torch.bfloat16, "cpu")  # 4 sequences x (1 + 5) tokens
    assert pm.ep_buffer_bytes(small, 8, 48, 4, 5) == b.nbytes
