"""The sample stage against small hand-computed and float64 references: each transform, greedy, logprobs,
seeded draws (batch-independent, seed-dependent, correctly distributed)."""

import math
import random

import pytest
import torch

from deepinfer.sampling import SampleRow, Sampler, SamplingParams, prompt_logprobs
from deepinfer.sampling import processors as proc
from deepinfer.sampling.logprobs import raw_logprobs
from deepinfer.sampling.row_columns import RowColumns, host_row, transform_

NEG_INF = float("-inf")


def row(params=None, seed=0, position=0, output_ids=(), prompt_ids=()):
    return SampleRow(params or SamplingParams(), seed, position, list(output_ids), list(prompt_ids))


def t(values):
    return torch.tensor([values], dtype=torch.float32)


# ---- each transform on hand-computed cases ----------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    x = t([2.0, -1.0, 0.5, 3.0])
    seen = torch.tensor([[True, True, False, False]])
    proc.apply_repetition_penalty_(x, seen, [2.0])
    assert x.tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_frequency_scales_with_count_and_presence_applies_once():
    x = t([2.0, -1.0, 0.5, 3.0])
    counts = proc.token_counts([[0, 0, 1]], 4, "cpu")
    proc.apply_additive_penalties_(x, counts, [0.5], [0.25])
    assert x.tolist() == [[2.0 - 2 * 0.5 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 3.0]]


def transformed(x, *params):
    """Steps 5-8 (temperature, top-k/top-p, min-p) as the sampler applies them, one row per params."""
    cols = RowColumns.from_host([host_row(p, x.shape[-1], []) for p in params], x.device)
    return transform_(x, list(params), cols)


def test_temperature_divides_logits():
    assert transformed(t([1.0, 2.0]), SamplingParams(temperature=0.5)).tolist() == [[2.0, 4.0]]


def test_a_row_that_samples_nothing_is_left_as_it_is():
    x = t([1.0, -2.5, 0.3])
    assert torch.equal(transformed(x.clone(), None), x)


def test_top_k_keeps_k_tokens_and_breaks_ties_by_lowest_id():
    x = t([1.0, 3.0, 3.0, 2.0, 3.0])
    proc.apply_top_k_top_p_(x, [2], [1.0])
    assert x.tolist() == [[NEG_INF, 3.0, 3.0, NEG_INF, NEG_INF]]


@pytest.mark.parametrize("top_p, kept", [(0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    x = t([math.log(p) for p in probs])
    proc.apply_top_k_top_p_(x, [-1], [top_p])
    assert [i for i, v in enumerate(x[0].tolist()) if v > NEG_INF] == kept


def test_top_p_is_measured_on_the_distribution_left_by_top_k():
    probs = [0.4, 0.3, 0.2, 0.1]  # after top-k=2: 4/7, 3/7; top_p=0.5 then keeps only the first
    x = t([math.log(p) for p in probs])
    proc.apply_top_k_top_p_(x, [2], [0.5])
    assert [i for i, v in enumerate(x[0].tolist()) if v > NEG_INF] == [0]
    x = t([math.log(p) for p in probs])
    proc.apply_top_k_top_p_(x, [2], [0.6])  # 4/7 = 0.571 < 0.6: the second one is needed
    assert [i for i, v in enumerate(x[0].tolist()) if v > NEG_INF] == [0, 1]


def test_rows_with_top_p_one_are_left_alone_beside_truncated_rows():
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)) * 8
    before = x[1].clone()
    proc.apply_top_k_top_p_(x, [5, -1], [0.5, 1.0])
    assert torch.equal(x[1], before)
    assert (x[0] > NEG_INF).sum() <= 5


def test_cutting_from_candidates_equals_sorting_the_whole_row():
    g = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    rows, ks, ps = [], [], []
    for i in range(200):
        # coarse values make ties at every boundary; some rows are mostly masked, some flat
        row = (torch.randn(3000, generator=g) * rng.choice([0.3, 1.0, 4.0, 12.0])).round(decimals=rng.choice([0, 1]))
        if i % 7 == 0:
            row[torch.rand(3000, generator=g) < 0.995] = NEG_INF
        rows.append(row)
        ks.append(rng.choice([-1, -1, 1, 3, 20, 100]))
        ps.append(rng.choice([1.0, 0.99, 0.9, 0.5, 0.1]))
    x = torch.stack(rows)
    via_candidates, full_sort = x.clone(), x.clone()
    proc.apply_top_k_top_p_(via_candidates, ks, ps, candidates=100)
    proc.apply_top_k_top_p_(full_sort, ks, ps, candidates=3000)
    assert torch.equal(via_candidates, full_sort)


@pytest.mark.parametrize("min_p, kept", [(0.2, [0, 1, 2]), (0.5, [0, 1]), (0.0, [0, 1, 2, 3])])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, kept):
    x = transformed(t([math.log(p) for p in [0.5, 0.3, 0.15, 0.05]]), SamplingParams(temperature=1.0, min_p=min_p))
    assert [i for i, v in enumerate(x[0].tolist()) if v > NEG_INF] == kept


# ---- greedy and the order of the pipeline -----------------------------------------------------------------------


def test_greedy_takes_the_argmax_and_ties_go_to_the_lowest_id():
    sampler = Sampler(vocab_size=6, eos_token_id=None)
    logits = t([0.0, 5.0, 1.0, 5.0, 5.0, -1.0])
    assert sampler.sample(logits, [row(SamplingParams(temperature=0.0))])[0].token_id == 1


def test_greedy_sees_penalties_before_the_argmax():
    # token 1 leads by 1.0 but was generated twice: frequency 0.75 costs it 1.5 -> token 0 wins.
    sampler = Sampler(vocab_size=3, eos_token_id=None)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.75)
    out = sampler.sample(t([2.0, 3.0, 0.0]), [row(params, output_ids=[1, 1])])
    assert out[0].token_id == 0


def test_repetition_penalty_covers_prompt_tokens():
    sampler = Sampler(vocab_size=3, eos_token_id=None)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sampler.sample(t([2.0, 3.0, 0.0]), [row(params, prompt_ids=[1])])[0].token_id == 0


def test_padding_columns_beyond_the_vocabulary_are_never_drawn():
    sampler = Sampler(vocab_size=4, eos_token_id=None)
    logits = t([0.0, 0.0, 0.0, 0.0, 100.0, 100.0])
    assert sampler.sample(logits, [row(SamplingParams(temperature=0.0))])[0].token_id == 0
    drawn = {sampler.sample(logits, [row(SamplingParams(), seed=s)])[0].token_id for s in range(50)}
    assert drawn <= {0, 1, 2, 3}


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    sampler = Sampler(vocab_size=5, eos_token_id=1)
    logits = t([0.0, 9.0, 1.0, 8.0, 2.0])  # eos (1) then stop token (3) lead
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert sampler.sample(logits, [row(params, position=1, output_ids=[0])])[0].token_id == 4
    assert sampler.sample(logits, [row(params, position=2, output_ids=[0, 4])])[0].token_id == 1


def test_min_tokens_with_ignore_eos_leaves_eos_an_ordinary_token():
    sampler = Sampler(vocab_size=3, eos_token_id=1)
    params = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler.sample(t([0.0, 9.0, 1.0]), [row(params)])[0].token_id == 1


def test_a_row_with_no_allowed_token_reports_an_error_and_others_still_sample():
    sampler = Sampler(vocab_size=2, eos_token_id=1)
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[0])
    out = sampler.sample(torch.zeros(2, 2), [row(params), row(SamplingParams(temperature=0.0))])
    assert out[0].error is not None and "no token is allowed" in out[0].error
    assert out[1].error is None and out[1].token_id == 0



@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_logits_end_their_row_with_an_error_that_says_so_not_a_token(bad):
    """A NaN row has no meaningful argmax: it must not come back as a token, nor as a grammar message."""
    from deepinfer.sampling import VerifyRequest

    sampler = Sampler(vocab_size=3, eos_token_id=2)
    logits = torch.tensor([[0.0, bad, 1.0], [0.0, 5.0, 1.0]])
    out = sampler.sample(logits, [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.8))])
    assert out[0].error is not None and "not finite" in out[0].error
    assert out[1].error is None
    # a verification whose last chosen row is non-finite: the drafts before it are accepted, then the error
    greedy = SamplingParams(temperature=0.0)
    rows = torch.tensor([[0.0, 9.0, 1.0], [bad, 0.0, 0.0]])
    (outs,) = sampler.verify(rows, [VerifyRequest(row(greedy), [1])])
    assert outs[0].token_id == 1 and outs[-1].error is not None and "not finite" in outs[-1].error


def _counting_host_reads(monkeypatch):
    reads = []
    inner = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or inner(self))
    return reads


def test_a_sampled_step_reads_once_whatever_its_rows_ask(monkeypatch):
    """Temperature, min-p, penalties, logit_bias, min_tokens bans and golden tokens beside greedy rows: their
    parameters travel as copies, the answer comes back in one read (tests/test_sampling_cuda.py counts the
    synchronisations on a GPU). On the CPU the top-k/top-p cut also reads, by design: its candidate check, free
    there, which the GPU's full sort does not need."""
    sampler = Sampler(vocab_size=50, eos_token_id=1)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, min_p=0.05, frequency_penalty=0.5, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, logit_bias={3: 5.0, 7: -2.0}, min_tokens=4, stop_token_ids=[9]),
              SamplingParams(temperature=0.9, golden_token_ids=[11, 12]),
              SamplingParams(temperature=0.0, logprobs=True)]
    rows = [row(p, seed=5 + i, position=1, output_ids=[2, 3], prompt_ids=[4]) for i, p in enumerate(params)]
    reads = _counting_host_reads(monkeypatch)
    out = sampler.sample(logits, rows)
    assert len(reads) == 1
    assert out[4].token_id == 12 and all(o.error is None for o in out)


def test_a_greedy_step_reads_the_device_once_and_matches_the_general_path(monkeypatch):
    """All rows greedy, none forced, no top logprobs: argmax, blocked rows and chosen logprobs come back in one
    read (each read is a synchronisation at decode). The outputs equal the general path's (forced here by asking
    one top logprob), for plain, tied, fully masked and non-finite rows, with logprobs reported or not."""
    sampler = Sampler(vocab_size=4, eos_token_id=1)
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 0.0], [0.0, float("nan"), 1.0, 0.0],
                           [1.0, 2.0, 0.0, 0.0]])
    blocked = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[0, 2, 3])  # eos 1 and 0, 2, 3 banned
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=True), blocked]
    reads = _counting_host_reads(monkeypatch)
    fast = sampler.sample(logits, [row(p) for p in params])
    assert len(reads) == 1
    general = sampler.sample(logits, [row(p) for p in params[:3]] + [row(SamplingParams(
        temperature=0.0, min_tokens=1, stop_token_ids=[0, 2, 3], logprobs=True, top_logprobs=1))])
    assert len(reads) > 2
    assert [o.token_id for o in fast[:3]] == [o.token_id for o in general[:3]] == [1, 0, 1]
    assert [o.error for o in fast] == [o.error for o in general]
    assert fast[3].error is not None and "no token is allowed" in fast[3].error and "not finite" in fast[2].error
    assert repr([o.logprob for o in fast[:3]]) == repr([o.logprob for o in general[:3]])  # NaN for the NaN row
    assert fast[0].top_logprobs is None


def test_a_greedy_verification_reads_the_device_once_and_keeps_its_logprobs(monkeypatch):
    """Greedy verification without top logprobs: every kept token is its row's argmax, so one read brings the
    verdicts' logprobs too; equal to the general path's (a request asking one top logprob)."""
    from deepinfer.sampling import VerifyRequest

    sampler = Sampler(vocab_size=5, eos_token_id=None)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, generator=g)
    target = logits.argmax(-1).tolist()
    drafts = [[target[0], target[1], (target[2] + 1) % 5], [target[4], target[5]]]  # 2 then all accepted
    fast_params = SamplingParams(temperature=0.0, logprobs=True)
    reads = _counting_host_reads(monkeypatch)
    fast = sampler.verify(logits, [VerifyRequest(row(fast_params), drafts[0]), VerifyRequest(row(fast_params),
                                                                                             drafts[1])])
    assert len(reads) == 1
    slow_params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=1)
    slow = sampler.verify(logits, [VerifyRequest(row(slow_params), drafts[0]), VerifyRequest(row(slow_params),
                                                                                             drafts[1])])
    assert [[(o.token_id, o.logprob, o.error) for o in outs] for outs in fast] == \
        [[(o.token_id, o.logprob, o.error) for o in outs] for outs in slow]
    assert [len(outs) for outs in fast] == [3, 3]


# ---- logprobs ---------------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_top_n_sorted_and_ties_by_id():
    logits = t([1.0, 3.0, 2.0, 3.0, -1.0])
    ref = torch.log_softmax(logits.double(), dim=-1)[0].tolist()
    sampler = Sampler(vocab_size=5, eos_token_id=None)
    # temperature and penalties change the draw, never the reported logprobs
    params = SamplingParams(temperature=0.0, top_logprobs=3, presence_penalty=2.0)
    out = sampler.sample(logits, [row(params, output_ids=[1])])[0]
    assert out.token_id == 3
    assert out.logprob == pytest.approx(ref[3], abs=1e-6)
    assert [tok for tok, _ in out.top_logprobs] == [1, 3, 2]
    assert [lp for _, lp in out.top_logprobs] == pytest.approx([ref[1], ref[3], ref[2]], abs=1e-6)


def test_top_logprobs_zero_reports_only_the_chosen_token():
    out = Sampler(vocab_size=3, eos_token_id=None).sample(t([0.0, 1.0, 2.0]), [row()])[0]
    assert out.top_logprobs is None and out.logprob is not None


def test_prompt_logprobs_score_each_prompt_token_with_the_previous_row():
    g = torch.Generator().manual_seed(3)
    prompt = [4, 0, 2, 2]
    logits = torch.randn(len(prompt), 6, generator=g)
    ref = torch.log_softmax(logits.double(), dim=-1)
    out = prompt_logprobs(logits, prompt, top_logprobs=2, vocab_size=6)
    assert out[0] is None
    for i in range(1, len(prompt)):
        assert out[i].token_id == prompt[i]
        assert out[i].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-6)
        best = torch.argsort(ref[i - 1], descending=True, stable=True)[:2].tolist()
        assert [tok for tok, _ in out[i].top_logprobs] == best


# ---- seeded draws -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_seeded_draws_do_not_depend_on_the_batch_around_them(batch_invariant):
    vocab = 512
    sampler = Sampler(vocab_size=vocab, eos_token_id=1, batch_invariant=batch_invariant)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(16, vocab, generator=g) * 2
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_p=0.5, presence_penalty=0.5),
    ]
    rows = [row(kinds[i % len(kinds)], seed=1000 + i, position=i % 4, output_ids=[7] * (i % 4)) for i in range(16)]
    alone = [sampler.sample(logits[i : i + 1], [rows[i]])[0] for i in range(16)]
    order = list(range(16))
    random.Random(5).shuffle(order)
    shuffled = sampler.sample(logits[order], [rows[i] for i in order])
    assert [out.token_id for out in shuffled] == [alone[i].token_id for i in order]
    if batch_invariant:  # the reported logprobs too, bit for bit
        assert [out.logprob for out in shuffled] == [alone[i].logprob for i in order]


def test_batch_invariant_logprobs_match_float64_log_softmax():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(8)) * 4
    ref = torch.log_softmax(logits.double(), dim=-1)
    got = raw_logprobs(logits, 1000, batch_invariant=True)
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=0)


def test_top_k_top_p_agree_with_the_float64_reference_on_random_rows():
    g = torch.Generator().manual_seed(21)
    rng = random.Random(21)
    for _ in range(60):
        vocab = rng.choice([7, 100, 1000])
        # coarse logits make ties common, so tie-breaking by id is exercised too
        values = (torch.randn(vocab, generator=g) * rng.choice([0.5, 2.0, 6.0])).round(decimals=1)
        params = SamplingParams(top_k=rng.choice([-1, 1, 5, 50]), top_p=rng.choice([0.3, 0.7, 0.95, 1.0]))
        expected = _reference_distribution(values.tolist(), params)
        x = values.unsqueeze(0).clone()
        proc.apply_top_k_top_p_(x, [params.top_k], [params.top_p])
        kept = [i for i, v in enumerate(x[0].tolist()) if v > NEG_INF]
        assert kept == [i for i, e in enumerate(expected) if e > 0], (vocab, params.top_k, params.top_p)


def test_different_seeds_and_positions_give_different_draws():
    sampler = Sampler(vocab_size=512, eos_token_id=None)
    logits = torch.zeros(1, 512)  # uniform: draws are pure noise
    by_seed = {sampler.sample(logits, [row(seed=s)])[0].token_id for s in range(64)}
    by_position = {sampler.sample(logits, [row(seed=1, position=p)])[0].token_id for p in range(64)}
    same = {sampler.sample(logits, [row(seed=9, position=3)])[0].token_id for _ in range(5)}
    assert len(by_seed) > 40 and len(by_position) > 40  # 64 uniform draws from 512 ids rarely collide
    assert len(same) == 1


def _reference_distribution(logits: list[float], p: SamplingParams) -> list[float]:
    """float64 transcription of the pipeline's definitions, for one row without penalties."""
    x = [v / p.temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    keep = set(order[: p.top_k] if p.top_k > 0 else order)
    z = sum(math.exp(x[i]) for i in keep)
    mass = 0.0
    for i in order:
        if i not in keep:
            continue
        if mass >= p.top_p and p.top_p < 1:
            keep.discard(i)
        mass += math.exp(x[i]) / z
    top = max(x[i] for i in keep)
    keep = {i for i in keep if math.exp(x[i] - top) >= p.min_p}
    z = sum(math.exp(x[i]) for i in keep)
    return [math.exp(x[i]) / z if i in keep else 0.0 for i in range(len(x))]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
    ],
)
def test_seeded_draws_over_many_seeds_follow_the_processed_distribution(params):
    logits = [0.3, 1.2, -0.5, 2.0, 0.0, 1.0, -1.5, 0.8]
    expected = _reference_distribution(logits, params)
    draws = 40_000
    sampler = Sampler(vocab_size=len(logits), eos_token_id=None)
    rows = [row(params, seed=s, position=s % 7) for s in range(draws)]
    tokens = [out.token_id for out in sampler.sample(t(logits).expand(draws, -1), rows)]
    counts = [tokens.count(i) for i in range(len(logits))]
    assert all(c == 0 for c, e in zip(counts, expected) if e == 0.0)
    support = [i for i, e in enumerate(expected) if e > 0]
    chi2 = sum((counts[i] - draws * expected[i]) ** 2 / (draws * expected[i]) for i in support)
    # chi-square with len(support)-1 <= 7 degrees of freedom: 35 is beyond its 1e-5 quantile
    assert chi2 < 35, (counts, [round(draws * e) for e in expected])
