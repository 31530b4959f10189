"""The golden fixtures on the GPU: float32 with the TileLang SM90 backend preferred (marker gpu).

The reference outputs were computed in float32 on the CPU; the same greedy tokens and logits within the CPU
tolerance must come back on CUDA, whichever backend each op kind resolved to."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ._helpers import FLASH_WIDTH

pytestmark = [pytest.mark.gpu, FLASH_WIDTH]

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


SMALL = dict(hidden_size=1024, vocab_size=1024, n_routed_experts=64, moe_intermediate_size=256, q_lora_rank=512,
             o_lora_rank=256, index_topk=64, candidate_topk_blocks=16, engram_vocab_size=1000)


def _spy(monkeypatch, module, name, calls):
    real = getattr(module, name)
    key = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"

    def wrapped(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def _run(model, prompts, follow):
    """Logits of a batched prefill (every position) and teacher-forced decode steps."""
    from deepinfer.models import ForwardBatch

    states = [model.new_state() for _ in prompts]
    logits = [model.forward(ForwardBatch(prompts, states, all_logits=True))]
    for toks in follow:
        logits.append(model.forward(ForwardBatch([[t] for t in toks], states)))
    return torch.cat(logits).float()


def test_kernel_sized_model_in_bf16_is_as_accurate_as_the_torch_ops(monkeypatch):
    """A V4.1 model of kernel-sized shapes (64 heads x 512, experts in FP4/FP8 as stored) in bf16 on CUDA: against
    the same model in float32 with the torch ops, the TileLang backend is as accurate as the torch ops in bf16 (a
    random-weight model amplifies bf16 rounding through its layers: bf16 vs fp32 differs by ~10% on the CPU too,
    so the bar is relative), and the kernels really ran (spied)."""
    from deepinfer.kernels.fp8_weight import Fp8BlockWeight
    from deepinfer.kernels.registry import OpSet
    from deepinfer.kernels.tilelang import attention, indexer, linear, moe
    from deepinfer.models import synthetic

    calls = {}
    for module, name in ((moe, "moe_experts_packed"), (moe, "jit"), (attention, "_run"), (indexer, "jit"),
                         (linear, "fp8_linear")):
        _spy(monkeypatch, module, name, calls)
    cfg = synthetic.config(SMALL)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (300, 17, 150)]
    follow = torch.randint(3, 500, (4, 3), generator=gen).tolist()
    ref = _run(synthetic.build_model(cfg, "cuda", torch.float32, backends=["torch"], seed=3), prompts, follow)
    model = synthetic.build_model(cfg, "cuda", torch.bfloat16, backends={"default": ["tilelang-sm90", "torch"]},
                                  seed=3)
    got = _run(model, prompts, follow)
    assert set(calls) >= {"moe.moe_experts_packed", "moe.jit", "attention._run", "indexer.jit",
                          "linear.fp8_linear"}, calls
    assert isinstance(model.layers[0].attn.wq_b, Fp8BlockWeight)  # synthetic models on CUDA hold FP8 projections
    model.use_ops(OpSet.build("cuda", ["torch"]))
    base = _run(model, prompts, follow)

    def rel(x):
        return ((x - ref).norm() / ref.norm()).item()

    def agree(x):
        return (x.argmax(-1) == ref.argmax(-1)).float().mean().item()

    assert torch.isfinite(got).all()
    print(f"vs fp32 torch: tilelang bf16 rel {rel(got):.4f} agree {agree(got):.3f}; "
          f"torch bf16 rel {rel(base):.4f} agree {agree(base):.3f}")
    assert rel(got) <= 1.5 * rel(base) + 1e-3, (rel(got), rel(base))
    assert agree(got) >= agree(base) - 0.1, (agree(got), agree(base))
