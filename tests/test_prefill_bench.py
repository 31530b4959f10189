"""benchmarks/prefill_gpu.py's YOCO measurement on the CPU: yoco_prefill drives the engine with yoco=off and with
the compact replay stage on the embedded tiny model (decoder layers 4..7, sliding window 16), the compact run skips
exactly the decoder-layer rows the replay stage accounts for and off none, and the target reads its ratio."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("prefill_gpu", ROOT / "benchmarks" / "prefill_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("prefill_gpu", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny():
    from deepinfer.embedded import materialize
    from deepinfer.models import load_model

    return load_model(materialize("tiny-random"), device="cpu", dtype=torch.float32)


def test_yoco_prefill_times_off_and_compact_through_the_engine(tiny):
    bench = _bench()
    # 200 tokens in chunks of 64, K = 24: chunks at 0 / 64 / 128 skip 63 / 63 / 48 rows (each keeps its last row),
    # the chunk at 192 lies inside the last K rows; 4 decoder layers
    got = bench.yoco_prefill(tiny, 200, 64, keep=24, warmup=False)
    assert got["failures"] == []
    assert (got["boundary"], got["consumer_layers"]) == (4, 4)
    off, comp = got["off"], got["compact"]
    assert off["steps"] == comp["steps"] == 4 and off["prefill_tokens"] == comp["prefill_tokens"] == 200
    assert off["rows_saved"] == 0 and comp["rows_saved"] == comp["rows_saved_expected"] == (63 + 63 + 48) * 4
    assert off["device_s"] > 0 and comp["device_s"] > 0 and not off["errors"] and not comp["errors"]
    assert got["speedup"] == pytest.approx(off["device_s"] / comp["device_s"])
    cfg = tiny.config
    (t,) = [t for t in bench.targets([], None, cfg, 1e12, "tiny", got) if t["name"].startswith("yoco")]
    assert t["measured"] == got["speedup"] and t["target"] == 1.8 and t["met"] == (got["speedup"] >= 1.8)
    assert t["name"] == "yoco=compact vs off at 200-token prefill (x)" and "K=24" in t["note"]
    (t,) = [t for t in bench.targets([], None, cfg, 1e12, "tiny") if t["name"].startswith("yoco")]
    assert t["measured"] is None and not t["met"]


def test_yoco_prefill_fails_a_prompt_the_replay_does_not_cut(tiny):
    got = _bench().yoco_prefill(tiny, 20, 64, keep=24, warmup=False)
    assert got["compact"]["rows_saved"] == 0
    assert got["failures"] == ["yoco=compact: no decoder-layer row skipped (a prompt of 20 tokens, K=24)"]


def test_profile_categories_name_the_compressor_and_engram_kernels():
    category = _bench().category
    assert category("compressor_pool_kernel") == "compressor"
    assert (category("engram_hash_kernel"), category("engram_gate_kernel")) == ("Engram", "Engram")
    assert category("sink_attention_decode_kernel") == "attention" and category("elementwise_kernel") == "other"


def test_mixed_cell_measures_prefill_beside_decoding_requests(tiny):
    """200 prompt tokens in chunks of 64 beside 4 decoders of 8-token prompts: after the decoders' own prefill, the
    long prompt's chunks ride in steps where all 4 decode, and those steps are the ones measured."""
    got = _bench().mixed_cell(tiny, 200, 64, decoders=4, short=8)
    assert got["failures"] == []
    assert got["mixed_steps"] >= 3 and 100 <= got["mixed_prefill_tokens"] <= 200
    assert got["mixed_decode_tokens"] >= 4 * got["mixed_steps"]
    assert got["tok_s"] > 0 and got["alone_tok_s"] > 0
    assert got["ratio"] == pytest.approx(got["tok_s"] / got["alone_tok_s"])
