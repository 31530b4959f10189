"""DSpark drafting for sampled requests by graph replay (issue 21: "sampled requests drafting on the device").

A captured graph reads no request parameter on the host, so each row's temperature, top-k, top-p, min-p and uniforms
sit in static tensors and every row takes every step with neutral values where its request asked for nothing
(deepinfer.sampling.static_drafts). Specified here: per row the drafted token and the draft distribution q (the
integer weights verification divides by) are eager drafting's (DraftChooser) bit for bit, for any mix of greedy and
sampled requests, with top-k/top-p by the full sort (what DraftChooser's candidate cut reproduces, ties included).
On the CPU the graph's replay is emulated by running what was captured again (tests/emulated_graphs.py, as for
greedy drafting); tests/gpu/test_sampled_drafting_gpu.py captures real ones, and
tests/gpu/test_engine_batch_invariance.py drafts seeded requests by graph replay through the engine.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import embedded
from deepinfer.models import ForwardBatch, load_model
from deepinfer.sampling import SamplingParams
from deepinfer.sampling.speculative import DraftChooser, DraftRequest
from deepinfer.sampling.static_drafts import StaticDraftChooser

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(temperature=0.0)
MIXES = {
    "temperature only": [SamplingParams(temperature=0.7), GREEDY, SamplingParams(temperature=1.3)],
    "min-p": [SamplingParams(temperature=0.9, min_p=0.05), GREEDY, SamplingParams(temperature=0.5)],
    "top-k and top-p": [SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=1.0, top_p=0.9),
                        GREEDY, SamplingParams(temperature=0.6, top_k=5, top_p=0.5, min_p=0.01),
                        SamplingParams(temperature=1.1)],
}


def _requests(params, seed=7):
    return [DraftRequest(p, seed + 1000 * r, 3 + r) for r, p in enumerate(params)]


def _assert_same_choice(static_weights, eager: DraftChooser, got_tokens, want_tokens, rows):
    assert torch.equal(got_tokens, want_tokens)
    for r in range(rows):
        for got, want in zip(static_weights[r], eager.weights[r]):
            assert (got is None) == (want is None), r
            if want is not None:
                assert torch.equal(got, want), r


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_the_static_chooser_draws_what_the_eager_chooser_draws(mix):
    """A 129,280-wide row (the padded Flash head; 129,000 real tokens), with ties at the top so that top-k's cut
    falls among equal logits: tokens and q per row equal DraftChooser's at every block position."""
    params = MIXES[mix]
    width, vocab, block = 129_280, 129_000, 3
    gen = torch.Generator().manual_seed(3)
    static = StaticDraftChooser(8, block, vocab, "cpu")
    eager = DraftChooser(_requests(params), vocab)
    shadow = DraftChooser(_requests(params), vocab)
    static.fill(shadow, len(params) + 1)  # a bucket one row wider than the batch: a neutral padding row
    cut = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
    pick = static.choose(cut)
    for i in range(block):
        logits = torch.randn(len(params) + 1, width, generator=gen) * 3
        logits[:, :50] = logits[:, :50].round()  # ties among the most likely tokens
        logits[:, :50] += 12
        got = pick(i, logits)[: len(params)]
        want = eager(i, logits[: len(params)])
        assert torch.equal(got, want), (mix, i)
    static.hand_over(shadow)
    _assert_same_choice(shadow.weights, eager, got, want, len(params))
    assert all(w is None for r, p in enumerate(params) if p.greedy for w in shadow.weights[r])


def test_without_top_k_or_top_p_the_uncut_mode_leaves_rows_whole():
    """The "sampled" mode skips the sort; a row asking for no cut is the same whichever mode drafts it."""
    params = MIXES["min-p"]
    vocab, block = 2_000, 2
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(5))
    outs = []
    for cut in (False, True):
        static = StaticDraftChooser(4, block, vocab, "cpu")
        chooser = DraftChooser(_requests(params), vocab)
        static.fill(chooser, len(params))
        tokens = [static.choose(cut)(i, logits) for i in range(block)]
        static.hand_over(chooser)
        outs.append((tokens, chooser.weights))
    (t0, w0), (t1, w1) = outs
    assert all(torch.equal(a, b) for a, b in zip(t0, t1))
    assert all((a is None and b is None) or torch.equal(a, b) for r0, r1 in zip(w0, w1) for a, b in zip(r0, r1))


def test_sampled_drafting_by_graph_replay_equals_eager_drafting():
    """DraftGraphs with the captured graph replaced by re-running what was captured: for greedy, sampled and
    top-k/top-p batches the drafts, confidences and every sampled row's q equal eager drafting with DraftChooser;
    each (bucket, mode) is captured once, and a request keeps its q after the next replay overwrites the buffer."""
    from deepinfer.engine.cuda_graphs import DraftGraphs
    from emulated_graphs import RerunDraftGraphs

    model = load_model(str(embedded.materialize("tiny-random")))
    vocab = model.config.vocab_size
    rng = random.Random(9)
    states = [model.new_state(6, drafts=True) for _ in range(5)]
    pools = states[0].pools
    for st in states:
        model.forward(ForwardBatch([[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]], [st]))
    graphs = RerunDraftGraphs(model.drafter, pools, max_batch=8, interval=4, block=5, vocab=vocab)
    kept = None
    for batch, mix in ((3, "temperature only"), (1, "temperature only"), (5, "top-k and top-p"), (3, "min-p")):
        chosen, params = states[:batch], MIXES[mix][:batch]
        golden = [rng.randrange(3, 500) for _ in chosen]
        slots, last = [s.slot for s in chosen], [s.num_tokens - 1 for s in chosen]
        seed = rng.randrange(1 << 30)
        chooser = DraftChooser(_requests(params, seed), vocab)
        tokens, conf = graphs.run(golden, slots, last, chooser)
        eager = DraftChooser(_requests(params, seed), vocab)
        step = model.drafter.step(torch.tensor(slots), torch.tensor(last), 5, pools)
        want = model.drafter.draft(torch.tensor(golden), step, pools, eager)
        assert torch.equal(conf, want.confidences), (batch, mix)
        _assert_same_choice(chooser.weights, eager, tokens, want.tokens, batch)
        if kept is None:
            kept = (chooser.weights[0][0], eager.weights[0][0])
    assert torch.equal(*kept)  # still the first batch's q after three more replays
    assert graphs.replays == 4
    assert set(graphs._graphs) == {(4, "sampled"), (1, "sampled"), (8, "cut"), (4, "sampled")}
    assert DraftGraphs.mode(DraftChooser(_requests([GREEDY]), vocab)) == "greedy"
