"""Balanced (mirror) context parallel prefill (issue 13 item 5, deepinfer/distributed/context_parallel.py).

With 2 and 4 gloo processes on the embedded tiny model (window 16, ratio-2 and ratio-1 KV sources, indexer with
candidate blocks, Engram, DSpark draft rings): every rank runs the same prefill steps with `cp=` (its mirror blocks
of each chunk), then decode steps without it on its own pools. Checked bitwise against the single-process model:
the logits of every step on every rank, and a digest of every cache pool tensor (window rings and their positions,
draft rings, compressed KV and indexer-key pages, open compression groups, Engram history) after every step. The
prompts run past the window (the compressed and indexer paths choose keys), include lengths not divisible by 2cp,
one- and three-token prompts (a rank that owns no row of the step), a second prefill chunk that starts mid
compression group, and every-row logits. Odd ranks take their slots and blocks in the opposite order: a rank's
pools need not be laid out like the others'."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer import embedded
from deepinfer.models import load_model
from deepinfer.models.batch import ForwardBatch
from deepinfer.models.cache import StandaloneAllocator
from deepinfer.distributed import groups
from deepinfer.distributed.context_parallel import ContextParallel, align_of, split_cuts

# A case: prefill steps (per step, per sequence: a chunk length, 0 = not in this step), then decode steps.
# (lengths per step, all_logits per step)
CASES = {
    # lengths past the window, not divisible by 4 or 8; a 1-token and a 3-token prompt in the same batch
    "batch": ([[45, 130, 7, 1, 3]], [False]),
    # chunked: sequence 0 in chunks of 37 (ends mid ratio-2 group) and 60; sequence 1 only in the first step
    "chunks": ([[37, 21], [60, 0]], [False, True]),
    # a step too small for every rank to own a row
    "tiny": ([[1, 2]], [True]),
    # one token per sequence: the step takes the decode attention path (rings as stored)
    "ones": ([[5, 4, 6], [1, 1, 1]], [False, False]),
}
# prompts of many windows and compressed blocks (ratio 1: > 256 entries, index_topk 16 of 8x8 candidates)
LONG_CASES = {
    "long": ([[700, 333, 2], [0, 129, 0]], [False, True]),
}
DECODE = 3
MAX_ROLLBACK = 2
BLOCK = 16


def _model():
    return load_model(embedded.materialize("tiny-random"))


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def digest(pools) -> dict[str, str]:
    """sha1 of every pool tensor's bytes, by name (bitwise comparison without shipping the pools)."""
    named = {"win_pos": pools.win_pos, "ngram": pools.ngram}
    for i, parts in enumerate(pools.window):
        named.update({f"window.{i}.{j}": p for j, p in enumerate(parts)})
    for i, parts in enumerate(pools.draft_window):
        named.update({f"draft_window.{i}.{j}": p for j, p in enumerate(parts)})
    for kind in ("compressed", "index_keys"):
        for s, parts in getattr(pools, kind).items():
            named.update({f"{kind}.{s}.{j}": p for j, p in enumerate(parts)})
    named.update({f"open_groups.{s}": p for s, p in pools.open_groups.items()})
    return {k: hashlib.sha1(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for k, v in named.items()}


def run_case(model, case, cp: ContextParallel | None, reverse: bool):
    """Logits of every step and the pools' digest after each. `reverse`: take slots and blocks in the opposite
    order (the sequences are created last first, and every sequence reserves its whole context up front)."""
    steps, all_logits = case
    n_seq = len(steps[0])
    blocks = sum(-(-(sum(s[i] for s in steps) + DECODE) // BLOCK) for i in range(n_seq))
    pools = model.allocate_cache(n_seq, blocks, BLOCK, MAX_ROLLBACK, drafts=True)
    alloc = StandaloneAllocator(pools)
    order = range(n_seq - 1, -1, -1) if reverse else range(n_seq)
    states = {i: alloc.new() for i in order}
    totals = [sum(s[i] for s in steps) + DECODE for i in range(n_seq)]
    for i in order:
        states[i].reserve(totals[i])
    toks = [_tokens(100 + i, totals[i]) for i in range(n_seq)]
    out, digests = [], []
    for lens, every in zip(steps, all_logits):
        seqs = [i for i in range(n_seq) if lens[i]]
        ids = [toks[i][states[i].num_tokens: states[i].num_tokens + lens[i]] for i in seqs]
        out.append(model.forward(ForwardBatch(ids, [states[i] for i in seqs], all_logits=every), cp=cp))
        digests.append(digest(pools))
    for _ in range(DECODE):
        ids = [[toks[i][states[i].num_tokens]] for i in range(n_seq)]
        out.append(model.forward(ForwardBatch(ids, [states[i] for i in range(n_seq)])))
        digests.append(digest(pools))
    return out, digests


def _worker(rank: int, world: int, init: str, cases: dict, want: dict) -> None:
    torch.set_num_threads(1)
    group = groups.init_group(rank, world, init, "cpu", timeout_s=60)
    try:
        model, cp = _model(), ContextParallel(group)
        assert (cp.rank, cp.size) == (rank, world)
        for name, case in cases.items():
            got, dig = run_case(model, case, cp, reverse=rank % 2 == 1)
            ref, ref_dig = want[name][rank % 2]
            for step, (g, w) in enumerate(zip(got, ref)):
                assert g.shape == w.shape and torch.equal(g, w), (
                    f"{name} rank {rank} step {step}: max |diff| {(g - w).abs().max().item()}")
            for step, (d, w) in enumerate(zip(dig, ref_dig)):
                bad = sorted(k for k in w if d[k] != w[k])
                assert not bad, f"{name} rank {rank} step {step}: pools differ from single-process in {bad}"
    finally:
        groups.destroy()


def check_cp(tmp_path, world: int, cases: dict) -> None:
    model = _model()
    want = {name: [run_case(model, case, None, rev) for rev in (False, True)] for name, case in cases.items()}
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/rendezvous", cases, want), nprocs=world, join=True)


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(300)
def test_cp2_prefill_then_decode_equals_single_process(tmp_path):
    check_cp(tmp_path, 2, CASES | LONG_CASES)


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(300)
def test_cp4_prefill_then_decode_equals_single_process(tmp_path):
    check_cp(tmp_path, 4, CASES)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cp3_equals_single_process(tmp_path):
    check_cp(tmp_path, 3, CASES | LONG_CASES)


# ---- in one process -------------------------------------------------------------------------------------------


def test_cp_of_one_is_the_plain_step():
    """A group of one runs the CP code path unsplit (query view, gathers, logit pick): the same bits."""
    model = _model()
    for case in CASES.values():
        (a, da), (b, db) = run_case(model, case, None, False), run_case(model, case, ContextParallel(), False)
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and da == db


class _Ranks(ContextParallel):
    def __init__(self, size: int):  # plan() only: no process group
        self.group, self.size, self.rank = None, size, 0


@pytest.mark.parametrize("size", [2, 3, 4])
def test_split_plan_mirror_blocks(size):
    cp = _Ranks(size)
    lengths, pasts = [1, 3, 16, 45, 130, 60], [0, 0, 0, 5, 0, 37]
    plan = cp.plan(lengths, pasts, align=2)
    # every step row is owned by exactly one rank, rows ascending per rank
    flat = sorted(r for rows in plan.rows for r in rows)
    assert flat == list(range(sum(lengths))) and all(list(r) == sorted(r) for r in plan.rows)
    start = 0
    for n, past, cuts in zip(lengths, pasts, plan.cuts):
        assert cuts[0] == 0 and cuts[-1] == n and list(cuts) == sorted(cuts)
        # interior cuts are whole compression groups in absolute positions (or the chunk's ends)
        assert all((past + c) % 2 == 0 or c in (0, n) for c in cuts[1:-1])
        for b in range(2 * size):  # block b and its mirror belong to rank min(b, 2size-1-b)
            r = min(b, 2 * size - 1 - b)
            assert set(range(start + cuts[b], start + cuts[b + 1])) <= set(plan.rows[r])
        start += n
    # balanced causal work on a long prompt: each rank's sum of (position + 1) within 10% of the mean
    long = cp.plan([4096], [0], align=2)
    work = [sum(p + 1 for p in rows) for rows in long.rows]
    assert max(work) / (sum(work) / size) < 1.1, work
    # the gather index inverts the per-rank layout
    pad, idx = plan.padded(), plan.gather_index()
    for r, rows in enumerate(plan.rows):
        assert idx[list(rows)].tolist() == [r * pad + j for j in range(len(rows))]
        assert (plan.owners()[list(rows)] == r).all()


def test_split_cuts_examples():
    assert split_cuts(10, 0, 2, 1) == [0, 3, 6, 9, 10]  # DeepInfer's ceil(n / 2cp) blocks
    assert split_cuts(10, 0, 2, 2) == [0, 4, 6, 10, 10]  # rounded up to whole ratio-2 groups
    assert split_cuts(10, 3, 2, 2) == [0, 3, 7, 9, 10]  # a chunk starting mid group: cuts at even positions
    assert align_of((0, 0, 2, 2, 1, 1)) == 2 and align_of((0, 0)) == 1


def test_cp_refuses_yoco_replay():
    model = _model()
    with pytest.raises(ValueError, match="does not support YOCO replay"):
        model.forward(ForwardBatch([[5, 6, 7]], [model.new_state()], replay=object()), cp=ContextParallel())
