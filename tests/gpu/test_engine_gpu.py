"""The engine on CUDA (marker gpu): `LLM.generate` reproduces the golden fixtures' greedy tokens (fp32, as the model
tests do) with async scheduling on and off; greedy outputs are identical with CUDA graphs on and off (bf16), and
graphs really replay; a bf16 model of kernel-sized shapes runs every step through the engine without any op kind the
TileLang backend was chosen for handing a call to torch."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ._helpers import FLASH_WIDTH

pytestmark = [pytest.mark.gpu, FLASH_WIDTH]

FIXTURES = Path(__file__).parent.parent / "fixtures" / "deepseek_v41"
NAMES = ["tiny-swa-csa2", "tiny-engram-hc4", "tiny-swa-csa2-fp8fp4"]


def _cases(name):
    raw = load_file(FIXTURES / name / "cases.safetensors")
    return [(raw[f"case{i}.input_ids"].tolist(), raw[f"case{i}.greedy_ids"].tolist()) for i in range(3)]


def _greedy(n):
    from deepinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("zero_overhead", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("name", NAMES)
def test_llm_generate_on_cuda_reproduces_the_fixture_greedy_tokens(name, zero_overhead):
    """All three cases in one generate call (batched, different lengths), TileLang preferred, fp32."""
    from deepinfer import LLM

    cases = _cases(name)
    with LLM(model=str(FIXTURES / name), hardware="sm90", dtype="float32", process="inproc",
             engine={"zero_overhead_scheduling": zero_overhead}) as llm:
        outs = llm.generate(prompt_token_ids=[ids for ids, _ in cases],
                            sampling_params=[_greedy(len(want)) for _, want in cases], use_tqdm=False)
    assert [o.token_ids for o in outs] == [want for _, want in cases]


def test_llm_generate_on_cuda_in_the_engine_process_reproduces_a_fixture():
    """The default deployment: the engine core in its own process, loading the model on CUDA there."""
    from deepinfer import LLM

    cases = _cases("tiny-swa-csa2")
    with LLM(model=str(FIXTURES / "tiny-swa-csa2"), hardware="sm90", dtype="float32") as llm:
        outs = llm.generate(prompt_token_ids=[ids for ids, _ in cases],
                            sampling_params=[_greedy(len(want)) for _, want in cases], use_tqdm=False)
    assert [o.token_ids for o in outs] == [want for _, want in cases]


def _run(model, eager, prompts, max_tokens):
    from deepinfer import LLM

    with LLM(model=model, hardware="sm90", dtype="bfloat16", process="inproc",
             runtime={"enforce_eager": eager}) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(max_tokens), use_tqdm=False)
        return [o.token_ids for o in outs], llm.last_metrics


@pytest.mark.parametrize("model", [None, str(FIXTURES / "tiny-engram-hc4")], ids=["embedded-tiny", "tiny-engram-hc4"])
def test_greedy_outputs_are_identical_with_cuda_graphs_on_and_off(model):
    """Six prompts of different lengths finish at different steps (max_tokens differs per prompt would hide it; the
    batch shrinks only through the lengths here), so decode steps replay several graph batch sizes."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 3, 90)]
    eager, m_eager = _run(model, True, prompts, 24)
    graphed, m_graph = _run(model, False, prompts, 24)
    assert m_eager["graph_steps"] == 0
    assert m_graph["graph_steps"] > 0, m_graph
    assert graphed == eager


SMALL = dict(hidden_size=1024, vocab_size=512, n_routed_experts=64, moe_intermediate_size=256, q_lora_rank=512,
             o_lora_rank=256, index_topk=64, candidate_topk_blocks=16, engram_vocab_size=1000)


def test_bf16_kernel_sized_model_through_the_engine_never_falls_back_per_call():
    """The test_model_gpu kernel-sized model (64 heads x 512, FP4/FP8 experts; vocab 512 = the package tokenizer's,
    so sampled ids stay inside Engram's token map) through the engine, graphs on: no kind whose chosen backend is
    TileLang hands a single call to torch, in prefill (chunked: 64-token budget) or decode; every op kind has a
    TileLang kernel, the compressor pooling and the Engram ops included."""
    from deepinfer.config.schema import Settings
    from deepinfer.engine import EngineOptions
    from deepinfer.frontend import LLMEngine
    from deepinfer.engine.backend import backend_from_model
    from deepinfer.kernels.registry import kernel_stats
    from deepinfer.models import synthetic

    model = synthetic.build_model(synthetic.config(SMALL), "cuda", torch.bfloat16,
                                  backends={"default": ["tilelang-sm90", "torch"]}, seed=3)
    covered = {k for k, b in model.ops.chosen.items() if b == "tilelang-sm90"}
    assert {"sink_attention_decode", "moe_experts", "moe_router", "linear", "index_topk_rows", "compressor_pool",
            "engram_hash", "engram_gate", "window_kv", "mhc_collapse_norm"} <= covered, covered
    backend = backend_from_model(model)
    before = kernel_stats()["fallbacks"]  # process-wide counters: other tests (fp32 fixtures) add their own
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (300, 17, 150, 2)]
    opts = EngineOptions.for_settings(Settings(), max_num_seqs=8, max_num_batched_tokens=64, memory_budget=1 << 28,
                                      process="inproc")
    with LLMEngine(lambda: backend, opts) as engine:
        outs = engine.generate(prompts, _greedy(12), use_tqdm=False)
        metrics = engine.last_metrics
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    after = kernel_stats()["fallbacks"]
    new = {k: {r: n - before.get(k, {}).get(r, 0) for r, n in v.items() if n != before.get(k, {}).get(r, 0)}
           for k, v in after.items() if k in covered}
    assert not {k: v for k, v in new.items() if v}, new
    assert metrics["graph_steps"] > 0, metrics
