"""Engram tables in host memory (`model.engram_storage=host`, deepinfer/models/engram_host.py): the tables leave the
device, each step copies the rows its tokens pick into buffers allocated once, and the outputs are bitwise those
of device tables: at the model (prefill, chunked prefill, decode steps), in the engine, and under dep2."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, embedded
from deepinfer.cli.requests import generate_requests
from deepinfer.models import ForwardBatch, load_model

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
    model.keep_engram_on_host(max_tokens=64)
    assert all(lw.engram is None or lw.engram.embed is None for lw in model.layers)  # the device copies are gone
    assert model.weight_bytes() == device_bytes - model.engram_host.host_bytes
    got = logits_of(model)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_step_larger_than_the_host_buffers_is_an_error():
    model = load_model(embedded.materialize("tiny-random"), draft_layers=False)
    model.keep_engram_on_host(max_tokens=8)
    with pytest.raises(ValueError, match="a step of 30 tokens; the host Engram buffers hold 8"):
        model.forward(ForwardBatch([list(range(100, 130))], [model.new_state()]))


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
