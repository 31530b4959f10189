"""Exactness: batching, chunked prefill, mixing and preemption never change a greedy output.

48 requests with random prompt lengths (1..300) and random max_tokens go through the engine with a token budget
far below the prompt lengths (every long prompt is chunked and shares steps with decodes) and a cache that holds
only a few sequences (requests are preempted and recomputed). Each output must equal the request run alone:
one prefill of its whole prompt, then one decode per token, straight through the model.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deepinfer.frontend import LLMEngine
from deepinfer.models import ForwardBatch, ModelConfig, load_model
from deepinfer.models.cache import CacheLayout
from deepinfer.sampling import SamplingParams
from options_helpers import settings_for

EOS = 1
FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41"
# Both have max_position_embeddings 1024; the second adds Engram layers (n-gram history in the state) and hc_mult 4.
MODELS = ["tiny-swa-csa2", "tiny-engram-hc4"]


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request):
    return str(FIXTURES / request.param)


def engine_layout(model_dir, block_size=16) -> CacheLayout:
    """The cache layout the engine uses with prefix caching on (the default): its rings keep a block's rows more,
    so a checkpoint can be taken after the step that runs past its boundary."""
    return CacheLayout(ModelConfig.from_file(Path(model_dir) / "config.json"), torch.float32, block_size,
                       checkpoint_lag=block_size - 1)


def small_budget(model_dir, slots=16, blocks=24, block_size=16, checkpoints=2) -> int:
    """Bytes for `slots` sequences' fixed state and `blocks` blocks of context (a 300-token prompt and a few more),
    plus `checkpoints` slots' worth: prefix caching (on by default) keeps its window checkpoints in a tenth of the
    budget, which is 2 slots here (test_small_budget_... checks it)."""
    layout = engine_layout(model_dir, block_size)
    return (slots + checkpoints) * layout.slot_bytes() + blocks * layout.block_bytes()


def test_small_budget_holds_16_sequences_24_blocks_and_2_window_checkpoints(model_dir):
    from deepinfer.engine.cache_manager import CacheManager

    layout = engine_layout(model_dir)
    cache = CacheManager.from_budget(small_budget(model_dir), layout.slot_bytes(), layout.block_bytes(), 16, 16,
                                     1024, prefix_caching=True, checkpoint_fraction=0.1)
    assert (cache.num_slots, cache.num_blocks, cache.checkpoint_slots) == (16, 24, 2)


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(2024)
    prompts, params = [], []
    for i in range(48):
        prompts.append([rng.randrange(3, 512) for _ in range(rng.randint(1, 300))])
        # Half may stop at EOS, half run to max_tokens: both ways of finishing are exercised.
        params.append(SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), ignore_eos=bool(i % 2)))
    return prompts, params


@pytest.fixture(scope="module")
def solo_outputs(workload, model_dir):
    model = load_model(model_dir)
    eos, vocab = model.config.eos_token_id, model.config.vocab_size
    outputs = []
    with torch.inference_mode():
        for prompt, p in zip(*workload):
            state = model.new_state()
            logits = model.forward(ForwardBatch([prompt], [state]))
            out = []
            while True:
                token = int(logits[0, :vocab].argmax())  # first maximum: ties go to the lowest id, as the sampler
                out.append(token)
                if len(out) == p.max_tokens or (token == eos and not p.ignore_eos):
                    break
                logits = model.forward(ForwardBatch([[token]], [state]))
            outputs.append(out)
    return outputs


@pytest.mark.parametrize("zero_overhead", [False, True], ids=["sync", "async"])
def test_batched_chunked_preempted_greedy_outputs_equal_each_request_run_alone(workload, model_dir, solo_outputs, zero_overhead):
    settings = settings_for(
        model_dir,
        process="inproc",
        zero_overhead_scheduling=zero_overhead,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        memory_budget=small_budget(model_dir),
        block_size=16,
    )
    with LLMEngine.for_settings(settings) as engine:
        outputs = engine.generate(*workload, use_tqdm=False)
        metrics = engine.last_metrics
    assert [o.request_id for o in outputs] == list(range(48))
    mismatched = [i for i, (o, want) in enumerate(zip(outputs, solo_outputs)) if o.token_ids != want]
    assert not mismatched, f"requests whose batched output differs from their solo run: {mismatched}"
    for o, p in zip(outputs, workload[1]):
        stopped = not p.ignore_eos and o.token_ids[-1] == EOS
        assert o.finish_reason == ("stop" if stopped else "length")
    assert metrics["preemptions"] > 0, "the cache is small enough to force preemption"
    assert metrics["mixed_steps"] > 0, "prefill chunks shared steps with decodes"
    assert metrics["generated_tokens"] == sum(len(o.token_ids) for o in outputs)
