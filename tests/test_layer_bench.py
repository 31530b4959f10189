"""benchmarks/layer_gpu.py on the CPU (embedded tiny model): its decode sequences live in one set of cache pools, each
with its own slot and blocks, their context filled by decode_gpu.fill_step (not prefilled); decode steps run the
real model with the layer clock; the main path writes prefill and decode rows."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("layer_gpu", ROOT / "benchmarks" / "layer_gpu.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["layer_gpu"] = bench
spec.loader.exec_module(bench)


@pytest.fixture(autouse=True)
def one_thread():
    # the CPU may be shared with other jobs: intra-op threads then slow the tiny model's small ops by 100x
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny():
    from deepinfer.embedded import materialize
    from deepinfer.models import load_model

    return load_model(materialize("tiny-random"), device="cpu", dtype=torch.float32)


def test_filled_sequences_decode_with_the_layer_clock(tiny):
    batch, ctx, steps = 2, 64, 2
    per_seq = bench.decode_blocks(ctx, 1 + steps)
    pools = tiny.allocate_cache(batch, batch * per_seq, bench.BLOCK_SIZE)
    gen, fill_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    states = bench.filled_sequences(tiny, pools, batch, ctx, per_seq, gen, fill_gen, {})
    assert [s.slot for s in states] == [0, 1] and all(s.pools is pools for s in states)
    assert not set(states[0].blocks) & set(states[1].blocks) and all(len(s.blocks) == per_seq for s in states)
    assert [s.num_tokens for s in states] == [ctx, ctx]
    assert (pools.win_pos[: batch * pools.layout.ring] >= 0).all()  # both slots' window rings written (ctx >= window)
    step_ms, layer_ms = bench.decode(tiny, states, steps, 1, gen)
    assert [s.num_tokens for s in states] == [ctx + 1 + steps] * batch
    assert len(layer_ms) == tiny.config.num_hidden_layers and step_ms > 0 and all(x > 0 for x in layer_ms)
    with pytest.raises(ValueError, match="cannot hold"):
        bench.filled_sequences(tiny, pools, batch + 1, ctx, per_seq, gen, fill_gen, {})


def test_main_on_the_cpu_writes_prefill_and_filled_decode_rows(tmp_path):
    out = tmp_path / "layer.json"
    rc = bench.main(["--model", "tiny", "--device", "cpu", "--batches", "2", "--contexts", "64", "--steps", "2",
                     "--torch-steps", "1", "--torch-prefill", "32", "--chunk", "32", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert "not prefilled" in data["meta"]["note"] and data["meta"]["model"] == "tiny"
    n_layers = len(data["rows"][0]["layer_ms"])
    pre = [(r["backend"], r["context"], r["tokens"]) for r in data["rows"] if r["mode"] == "prefill"]
    assert pre == [("default", 32, 32), ("default", 64, 32), ("torch", 32, 32)]  # 64 tokens in chunks of 32
    dec = [r for r in data["rows"] if r["mode"] == "decode"]
    assert [(r["backend"], r["batch"], r["context"]) for r in dec] == [("default", 2, 64), ("torch", 2, 64)]
    for r in data["rows"]:
        assert r["step_ms"] > 0 and len(r["layer_ms"]) == len(r["floor"]) == n_layers
    assert all(r["context_source"] == "filled" for r in dec)
