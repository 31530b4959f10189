"""The sample stage on a CUDA device: draws equal to the CPU's and independent of the batch around them
(marker gpu; skipped without a GPU)."""

import dataclasses
import random
import warnings

import pytest
import torch

from deepinfer.sampling import SampleRow, Sampler, SamplingParams
from deepinfer.sampling.fixed_point import draw_from_weights, fixed_point_weights

pytestmark = pytest.mark.gpu
KINDS = [
    SamplingParams(temperature=0.8, top_p=0.9, top_logprobs=5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=50, min_p=0.02),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.1, top_p=0.95, frequency_penalty=0.3, repetition_penalty=1.2),
    SamplingParams(temperature=0.9, top_k=20, logit_bias={5: 2.0, 17: -1.5}, min_tokens=3, stop_token_ids=[9]),
    SamplingParams(temperature=0.8, golden_token_ids=[4, 8, 15]),
]


def _batch(vocab, rows, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    sample_rows = [
        SampleRow(KINDS[i % len(KINDS)], 77 + i, i % 5, [3 * i % vocab] * (i % 5), [5, 6, 7]) for i in range(rows)
    ]
    return logits, sample_rows


@pytest.mark.parametrize("vocab", [512, 129280])
def test_cuda_draws_equal_cpu_draws(vocab):
    logits, rows = _batch(vocab, 40, seed=vocab)
    sampler = Sampler(vocab, eos_token_id=1)
    cpu = [o.token_id for o in sampler.sample(logits, rows)]
    gpu = [o.token_id for o in sampler.sample(logits.cuda(), rows)]
    assert gpu == cpu


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cuda_draws_do_not_depend_on_the_batch(batch_invariant):
    vocab = 129280
    logits, rows = _batch(vocab, 16, seed=4)
    logits = logits.cuda()
    sampler = Sampler(vocab, eos_token_id=1, batch_invariant=batch_invariant)
    alone = [sampler.sample(logits[i : i + 1], [rows[i]])[0] for i in range(16)]
    order = list(range(16))
    random.Random(9).shuffle(order)
    together = sampler.sample(logits[order], [rows[i] for i in order])
    assert [o.token_id for o in together] == [alone[i].token_id for i in order]
    if batch_invariant:
        assert [o.logprob for o in together] == [alone[i].logprob for i in order]
        assert [o.top_logprobs for o in together] == [alone[i].top_logprobs for i in order]


def test_top_p_mass_is_bitwise_the_same_for_one_row_and_a_batch():
    # a single row and a batch take different CUDA scan kernels; the integer prefix sum makes that irrelevant
    x = torch.randn(64, 129280, device="cuda") * 3
    w = fixed_point_weights(x)
    batch = torch.cumsum(w, dim=-1)
    assert all(torch.equal(torch.cumsum(w[i], dim=-1), batch[i]) for i in range(0, 64, 7))


def test_the_integer_cdf_draw_is_the_same_on_cuda_and_cpu():
    x = torch.randn(32, 129280) * 2
    u = [random.Random(i).random() for i in range(32)]
    assert draw_from_weights(fixed_point_weights(x.cuda()), u) == draw_from_weights(fixed_point_weights(x), u)


def test_a_sampled_step_reads_the_device_once():
    # right after the step's graph replay every wait for the device leaves it idle: the rows' parameters travel
    # as queued copies and the answer (tokens, why none could be chosen, logprobs) comes back in one read. torch's
    # sync debug mode warns at each synchronising call
    logits, rows = _batch(129280, 16, seed=3)
    rows = [dataclasses.replace(r, params=dataclasses.replace(r.params, top_logprobs=0)) for r in rows]
    sampler = Sampler(129280, eos_token_id=1)
    logits = logits.cuda()
    sampler.sample(logits, rows)  # first use: allocations, lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sampler.sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
