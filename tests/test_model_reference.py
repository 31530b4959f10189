"""The model reproduces the transformers reference (golden fixtures) in every way it can be run:
one-shot prefill, chunked prefill at any split, token-by-token decode, and batched with others."""

import pytest
import torch

from deepinfer.models import ForwardBatch
from model_fixtures import NAMES, TOL, cases, model


def greedy_decode(m, states, last_logits, steps):
    """Greedy continuation for several sequences at once; returns (ids, per-step logits) per sequence."""
    ids = [[] for _ in states]
    logits = [[] for _ in states]
    for _ in range(steps):
        nxt = last_logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            ids[i].append(t)
            logits[i].append(last_logits[i])
        last_logits = m.forward(ForwardBatch([[t] for t in nxt], states))
    return ids, [torch.stack(x) for x in logits]


@pytest.mark.parametrize("name", NAMES)
def test_one_shot_prefill_matches_reference_logits(name):
    m = model(name)
    for case in cases(name):
        logits = m.forward(ForwardBatch([case["input_ids"].tolist()], [m.new_state()], all_logits=True))
        assert (logits - case["prefill_logits"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_cached_decode_matches_greedy_reference(name):
    m = model(name)
    for case in cases(name):
        st = m.new_state()
        last = m.forward(ForwardBatch([case["input_ids"].tolist()], [st]))
        ids, logits = greedy_decode(m, [st], last, len(case["greedy_ids"]))
        assert ids[0] == case["greedy_ids"].tolist()
        assert (logits[0] - case["greedy_logits"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunks", [(1,), (3, 7), (5, 2, 11), (2,) * 4, (8, 1, 1, 9)])
def test_chunked_prefill_matches_one_shot(name, chunks):
    """Splits land inside compression groups (odd offsets) and across window boundaries."""
    m = model(name)
    for case in cases(name):
        ids = case["input_ids"].tolist()
        st, rows, at = m.new_state(), [], 0
        for size in list(chunks) + [len(ids)]:
            piece = ids[at : at + size]
            if not piece:
                break
            rows.append(m.forward(ForwardBatch([piece], [st], all_logits=True)))
            at += len(piece)
        logits = torch.cat(rows)
        assert logits.shape[0] == len(ids)
        assert (logits - case["prefill_logits"]).abs().max().item() <= TOL
        ids_out, step_logits = greedy_decode(m, [st], logits[-1:], len(case["greedy_ids"]))
        assert ids_out[0] == case["greedy_ids"].tolist()
        assert (step_logits[0] - case["greedy_logits"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_three_cases_batched_together_match_reference(name):
    m = model(name)
    cs = cases(name)
    states = [m.new_state() for _ in cs]
    last = m.forward(ForwardBatch([c["input_ids"].tolist() for c in cs], states))
    ids, logits = greedy_decode(m, states, last, len(cs[0]["greedy_ids"]))
    for i, c in enumerate(cs):
        assert ids[i] == c["greedy_ids"].tolist()
        assert (logits[i] - c["greedy_logits"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["tiny-swa-csa2", "tiny-engram-hc4"])
def test_rows_are_bitwise_independent_of_batch_and_chunking(name):
    """A sequence's logits are bit-identical alone, batched with others, or chunked differently."""
    m = model(name)
    cs = cases(name)
    ids = cs[2]["input_ids"].tolist()
    alone = m.forward(ForwardBatch([ids], [m.new_state()], all_logits=True))
    st, rows = m.new_state(), []
    for a, b in [(0, 5), (5, 6), (6, 19), (19, len(ids))]:
        other = m.new_state()
        out = m.forward(ForwardBatch([cs[0]["input_ids"].tolist(), ids[a:b]], [other, st], all_logits=True))
        rows.append(out[len(cs[0]["input_ids"]) :])
    assert torch.equal(torch.cat(rows), alone)


@pytest.mark.parametrize("name", ["tiny-swa-csa2", "tiny-engram-hc4"])
def test_rollback_restores_the_state_before_the_rolled_back_tokens(name):
    m = model(name)
    ids = cases(name)[1]["input_ids"].tolist()
    ref_state = m.new_state(max_rollback=4)
    m.forward(ForwardBatch([ids[:30]], [ref_state]))
    expected = m.forward(ForwardBatch([ids[30:34]], [ref_state], all_logits=True))
    st = m.new_state(max_rollback=4)
    m.forward(ForwardBatch([ids[:33]], [st]))  # 33: rolls back across a compression-group boundary
    m.forward(ForwardBatch([[7]], [st]))
    st.rollback(4)
    assert st.num_tokens == 30
    got = m.forward(ForwardBatch([ids[30:34]], [st], all_logits=True))
    assert torch.equal(got, expected)


def test_state_accounting_reports_growth_and_frees():
    m = model("tiny-swa-csa2")
    st = m.new_state()
    before = st.nbytes()
    m.forward(ForwardBatch([list(range(3, 200))], [st]))
    assert st.nbytes() > before
    layout = m.cache_layout()
    assert layout.bytes_per_token() > 0 and layout.slot_bytes() > 0
    st.free()
    assert st.nbytes() == 0
