"""Engram tables in host memory (`model.engram_storage=host`, deepinfer/models/engram_host.py): the tables leave the
device (kept as FP8 rows where that is exact), each step gathers the rows its tokens pick, and the outputs are
bitwise those of device tables: at the model (prefill, chunked prefill, decode steps; moved after loading or loaded
straight into host memory), in the engine, and under dep2 (tests/test_parallel_engine.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, embedded
from deepinfer.cli.requests import generate_requests
from deepinfer.models import ForwardBatch, load_model
from deepinfer.models.engram_host import fp8_rows_exact, to_host_table

PROMPTS = [[5, 77, 301, 9, 12, 40, 41, 42, 300, 17, 18], [3, 4, 8, 9], list(range(100, 130))]


def logits_of(model) -> list[torch.Tensor]:
    states = [model.new_state() for _ in PROMPTS]
    out = [model.forward(ForwardBatch([p[:-3] for p in PROMPTS], states, all_logits=True)),
           model.forward(ForwardBatch([p[-3:] for p in PROMPTS], states, all_logits=True))]
    for t in range(4):
        out.append(model.forward(ForwardBatch([[7 + t], [200 + t], [450 - t]], states)))
    return out


def test_host_tables_give_the_logits_of_device_tables():
    model_dir = embedded.materialize("tiny-random")
    want = logits_of(load_model(model_dir, draft_layers=False))
    model = load_model(model_dir, draft_layers=False)
    device_bytes = model.weight_bytes()
    model.keep_engram_on_host()
    assert all(lw.engram is None or lw.engram.embed is None for lw in model.layers)  # the device copies are gone
    # the tables' values are FP8-representable: kept as codes + one scale per 32 channels (1 + 1/32 B a value)
    assert all(t.scales is not None and t.codes.dtype == torch.uint8 for t in model.engram_host.tables)
    assert model.weight_bytes() == device_bytes - 4 * model.engram_host.host_bytes * 32 // 33  # fp32 tables before
    got = logits_of(model)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # loaded straight into host memory from the files (their own codes and scales, which may encode a value
    # differently from a re-quantisation, e.g. -0): the same rows' values, the same logits
    direct = load_model(model_dir, draft_layers=False, engram_storage="host")
    for j, table in enumerate(direct.engram_host.tables):
        ids = torch.arange(table.codes.shape[0])[:, None]  # every row
        assert torch.equal(direct.engram_host.rows(j, ids), model.engram_host.rows(j, ids))
    assert all(torch.equal(g, w) for g, w in zip(logits_of(direct), want))


def test_fp8_rows_are_kept_only_where_exact():
    g = torch.Generator().manual_seed(0)
    exact = (torch.randn(100, 64, generator=g) * 3).to(torch.float8_e4m3fn).float() * 2.0 ** -5
    codes, scales = fp8_rows_exact(exact)
    back = codes.view(torch.float8_e4m3fn).float() * torch.exp2(scales.float() - 127).repeat_interleave(32, 1)
    assert torch.equal(back, exact)
    assert fp8_rows_exact(torch.randn(100, 64, generator=g)) is None  # 24-bit mantissas do not fit 3 bits
    dense = to_host_table(torch.randn(10, 64, generator=g), pin=False)
    assert dense.scales is None and dense.codes.dtype == torch.float32


REQUESTS = [{"prompt_token_ids": p, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True} for p in PROMPTS]


def test_the_engine_with_host_tables_returns_the_tokens_of_device_tables():
    runs = {}
    for storage in ("device", "host"):
        with LLM("tiny_random", process="inproc", runtime={"num_threads": 1},
                 overrides=[f"model.engram_storage={storage}"]) as llm:
            runs[storage] = [o.token_ids for o in generate_requests(llm, REQUESTS)]
            model = llm._engine.client.core.runner.backend.model
            assert (model.engram_host is not None) == (storage == "host")
    assert runs["host"] == runs["device"]


@pytest.mark.parametrize("value, storage", [("1", "device"), ("true", "device"), ("0", "host"), ("False", "host")])
def test_deepinfers_force_gpu_storage_variable_picks_the_storage(monkeypatch, value, storage):
    from deepinfer.config.compose import compose
    from deepinfer.config.resolve import resolve

    monkeypatch.setenv("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE", value)
    assert resolve(compose(["model=v41_flash"])).model.engram_storage == storage
    assert resolve(compose(["model.engram_storage=device"])).model.engram_storage == "device"  # the CLI wins


def test_a_bad_force_gpu_storage_value_is_one_line_naming_the_variable(monkeypatch):
    from deepinfer.config.compose import compose
    from deepinfer.config.errors import ConfigError
    from deepinfer.config.resolve import resolve

    monkeypatch.setenv("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE", "maybe")
    with pytest.raises(ConfigError, match="DEEPINFER_ENGRAM_FORCE_GPU_STORAGE='maybe' is not allowed; allowed: 1"):
        resolve(compose([]))
