"""The golden fixtures on the GPU: float32 with the TileLang SM90 backend preferred (marker gpu).

The reference outputs were computed in float32 on the CPU; the same greedy tokens and logits within the CPU
tolerance must come back on CUDA, whichever backend each op kind resolved to."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FIXTURES = Path(__file__).parent.parent / "fixtures" / "deepseek_v41"


@pytest.mark.parametrize("name", ["tiny-swa-csa2", "tiny-engram-hc4", "tiny-swa-csa2-fp8fp4"])
def test_fixture_greedy_tokens_on_cuda_with_tilelang_backend(name):
    from deepinfer.models import ForwardBatch, load_model

    model = load_model(FIXTURES / name, device="cuda", dtype=torch.float32,
                       backends={"default": ["tilelang-sm90", "torch"]})
    assert "tilelang-sm90" in set(model.ops.chosen.values())
    raw = load_file(FIXTURES / name / "cases.safetensors")
    for i in range(3):
        ids, want = raw[f"case{i}.input_ids"].tolist(), raw[f"case{i}.greedy_ids"].tolist()
        state = model.new_state()
        logits = model.forward(ForwardBatch([ids], [state]))
        got = []
        for step in range(len(want)):
            assert (logits[0].cpu() - raw[f"case{i}.greedy_logits"][step]).abs().max().item() <= 1e-3
            got.append(int(logits[0].argmax()))
            logits = model.forward(ForwardBatch([[got[-1]]], [state]))
        assert got == want
