"""Deterministic sampling and batch invariance (issue 5, "Done when").

1. Through LLM.generate on the embedded model: a request with seq_seed samples the same tokens (temperature 0.8,
   top_p 0.9) alone, in a batch of 16 in random order (prefills chunked and mixed with decodes by a small step
   budget), with async scheduling on and off.
2. At the model level with batch invariance on: one sequence's logits are bitwise equal alone, in batches of
   2..16 sequences of other lengths, and under different prefill chunkings.
"""

import random

import pytest
import torch

from deepinfer import LLM
from deepinfer.models import ForwardBatch, load_model
from deepinfer.sampling import SamplingParams
from model_fixtures import FIXTURES

VOCAB = 512  # the embedded model's and the fixtures'


def random_prompts(rng, n):
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def test_seeded_outputs_are_the_same_alone_in_any_batch_order_sync_and_async():
    rng = random.Random(5)
    prompts = random_prompts(rng, 16)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seq_seed=rng.getrandbits(64)) for _ in prompts]
    runs = {}
    for zero_overhead in (False, True):
        engine = {"zero_overhead_scheduling": zero_overhead, "max_num_batched_tokens": 48}
        with LLM(process="inproc", engine=engine) as llm:
            alone = [llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0].token_ids
                     for p, sp in zip(prompts, params)]
            order = list(range(16))
            rng.shuffle(order)
            batch = llm.generate(prompt_token_ids=[prompts[i] for i in order], sampling_params=[params[i] for i in order],
                                 use_tqdm=False)
            in_batch = [None] * 16
            for i, out in zip(order, batch):
                in_batch[i] = out.token_ids
        assert in_batch == alone
        runs[zero_overhead] = alone
    assert runs[False] == runs[True]
    assert len({tuple(t) for t in runs[True]}) == 16  # the seeds matter: no two requests agree


def embedded_dir():
    from deepinfer import embedded

    return embedded.materialize("tiny-random")


MODELS = {
    "embedded-tiny": embedded_dir,
    "tiny-swa-csa2": lambda: FIXTURES / "tiny-swa-csa2",
    "tiny-engram-hc4": lambda: FIXTURES / "tiny-engram-hc4",
}


@pytest.mark.parametrize("name", list(MODELS))
def test_batch_invariant_logits_are_bitwise_equal_in_any_batch_and_chunking(name):
    m = load_model(MODELS[name](), batch_invariant=True)
    rng = random.Random(11)
    target = [rng.randrange(2, VOCAB) for _ in range(45)]
    alone = m.forward(ForwardBatch([target], [m.new_state()], all_logits=True))

    for size in range(2, 17):  # one-shot prefill among size - 1 other sequences, at a random place in the batch
        others = random_prompts(rng, size - 1)
        at = rng.randrange(size)
        seqs = others[:at] + [target] + others[at:]
        out = m.forward(ForwardBatch(seqs, [m.new_state() for _ in seqs], all_logits=True))
        start = sum(len(s) for s in seqs[:at])
        assert torch.equal(out[start : start + len(target)], alone), f"batch of {size}"

    for cuts in [(1, 2, 3), (7, 30), (16, 32), (44,), tuple(range(1, 45))]:  # the last: prefill one token a step
        state, rows, bounds = m.new_state(), [], (0, *cuts, len(target))
        for a, b in zip(bounds, bounds[1:]):
            others = random_prompts(rng, rng.randint(1, 5))
            out = m.forward(ForwardBatch([*others, target[a:b]], [*(m.new_state() for _ in others), state], all_logits=True))
            rows.append(out[out.shape[0] - (b - a) :])
        assert torch.equal(torch.cat(rows), alone), f"chunks at {cuts}"
