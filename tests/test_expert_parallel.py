"""Expert-parallel MoE (deepinfer/distributed/expert_parallel.py) against the single-process op, bitwise, on the CPU
with gloo: 2 and 4 processes spawned with torch.multiprocessing, each owning some tokens (one rank none) and its
experts' weights, with experts no token picks and with redundant (replicated, shuffled) physical experts; both the
variable-size dispatch and the static-capacity one (deepinfer/distributed/ep_dispatch.py), where every rank's rows
may all go to one peer (the worst case the buffers are sized for), and with the buffers' views sized for the agreed
bucket of the largest rank's tokens (the capacity a step uses); and the engine's per-step agreement (agree_step)."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer.kernels.packed_experts import pack_quantized
from deepinfer.kernels.torch.moe import moe_experts
from deepinfer.distributed import groups
from deepinfer.distributed.eplb import rebalance
from deepinfer.distributed.ep_dispatch import (UNUSED_META, StaticBuffers, StepPath, agree_static, agree_step,
                                              capacity_rows, send_rows)
from deepinfer.distributed.expert_parallel import (ExpertParallel, _pack, _unpack, choose_copies, ep_moe_experts,
                                                   local_experts)
from deepinfer.distributed.placement import ExpertPlacement
from deepinfer.models.random_weights import _fp4_rows

N_EXP, TOP_K, D, INTER, LIMIT = 8, 3, 64, 32, 10.0
UNUSED = (2, 5)  # experts no token picks


def problem(seed: int, tokens: int, dtype: torch.dtype):
    """Tokens, routing and weights, the same on every rank (drawn from `seed`)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, D, generator=g) * 2).to(dtype)
    scores = torch.rand(tokens, N_EXP, generator=g)
    scores[:, list(UNUSED)] = -1.0
    idx = scores.topk(TOP_K, dim=-1).indices
    w = torch.rand(tokens, TOP_K, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True) * 1.5

    def expert():
        return (torch.randn(INTER, D, generator=g).div(math.sqrt(D)).to(dtype),
                torch.randn(D, INTER, generator=g).div(math.sqrt(INTER)).to(dtype),
                torch.randn(INTER, D, generator=g).div(math.sqrt(D)).to(dtype))

    return x, w, idx, [expert() for _ in range(N_EXP)], expert()


def packed_problem(seed: int, tokens: int):
    """The same with routed experts stored as FP4 (the release format), kept packed."""
    x, w, idx, _, shared = problem(seed, tokens, torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    packed = pack_quantized([(_fp4_rows((64, D), g), _fp4_rows((D, 64), g), _fp4_rows((64, D), g))
                             for _ in range(N_EXP)])
    return x, w, idx, packed, shared


def run_case(rank: int, world: int, split: list[int], placement: ExpertPlacement, dtype, seed: int,
             packed: bool = False, static: bool = False) -> None:
    total = sum(split)
    x, w, idx, experts, shared = packed_problem(seed, total) if packed else problem(seed, total, dtype)
    if static:  # every token of one rank picks the experts of one peer: the per-peer worst case
        idx = torch.tensor([[0, 1, 3]] * total) if world == 2 else idx
    want = moe_experts(x, w, idx, experts, shared, LIMIT)  # the single-process op over every token
    lo, hi = sum(split[:rank]), sum(split[:rank + 1])
    load = torch.zeros(placement.per_rank, dtype=torch.int64)
    buffers = None
    if static:
        buffers = StaticBuffers.allocate(max(split), TOP_K, placement.per_rank, world, D, x.dtype, "cpu")
        assert agree_static(buffers, hi - lo, None)  # the largest rank's step fits
    got = ep_moe_experts(x[lo:hi], w[lo:hi], idx[lo:hi], local_experts(experts, placement, rank), shared, LIMIT,
                         placement, load=load, buffers=buffers)
    assert got.dtype == want.dtype and got.shape == (hi - lo, D)
    assert torch.equal(got, want[lo:hi]), (
        f"rank {rank}: max |diff| {(got.float() - want[lo:hi].float()).abs().max().item()}")
    # the rows each logical expert computed, summed over ranks, are the times it was picked
    per_logical = torch.zeros(N_EXP, dtype=torch.int64)
    per_logical.index_add_(0, torch.tensor(placement.local_logical(rank)), load)
    torch.distributed.all_reduce(per_logical)
    assert torch.equal(per_logical, torch.bincount(idx.reshape(-1), minlength=N_EXP))


def check_agree_step(rank: int, world: int) -> None:
    """The engine's per-step agreement: static while every rank's tokens fit (the largest decides), sized for the
    largest rank's tokens rounded up to a bucket, and a capture on any rank at that capacity is every rank's to
    pair (one at another capacity is not); a step that is not static captures nothing."""
    buffers = StaticBuffers.allocate(4, TOP_K, 2, world, D, torch.float32, "cpu")
    assert agree_step(buffers, 1 + rank, [], None) == StepPath(True, 0, world)  # no buckets: the largest itself
    buffers.set_buckets([1, 2, 4])
    assert agree_step(buffers, 1 + rank, [False, rank == 0, rank == 0], None) == StepPath(True, 1, min(4, world))
    assert agree_step(buffers, 1, [False, False, True], None) == StepPath(True, 0, 1)
    assert agree_step(buffers, 3, [], None) == StepPath(True, 0, 4)
    assert agree_step(buffers, 5 if rank == world - 1 else 1, [True] * 3, None) == StepPath(False, 0)


class RowsMoved:
    """Stands in for torch.distributed in ep_dispatch: records the rows of every all-to-all, forwards the rest."""

    def __init__(self):
        self.rows = []

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def all_to_all_single(self, output, input, *args, **kwargs):
        self.rows.append(input.shape[0])
        return torch.distributed.all_to_all_single(output, input, *args, **kwargs)


def check_bucketed_capacity(rank: int, world: int) -> None:
    """Ranks of 1, 3, 5, ... tokens: every rank's forward uses views of the buffers sized for the bucket of the
    largest rank's tokens (the all-to-alls move that many rows), and its output is bitwise the op's and the
    max-capacity forward's."""
    from deepinfer.distributed import ep_dispatch

    split = [1 + 2 * r for r in range(world)]
    largest = split[-1]
    bucket = 1 << (largest - 1).bit_length()  # the buckets below are powers of two
    x, w, idx, experts, shared = problem(9, sum(split), torch.float32)
    want = moe_experts(x, w, idx, experts, shared, LIMIT)
    placement = ExpertPlacement.initial(N_EXP, world)
    ep = ExpertParallel(placement, rank)
    ep.plan_static(16, TOP_K, D, x.dtype, "cpu")
    ep.buffers.set_buckets([1, 2, 4, 8, 16])
    lo, hi = sum(split[:rank]), sum(split[:rank + 1])
    assert ep.begin_forward(hi - lo)  # agree_static over the world group
    view, cap = ep.step_buffers, bucket * min(TOP_K, placement.per_rank)
    assert (view.max_tokens, view.capacity, view.recv_x.shape[0]) == (bucket, cap, world * cap)
    assert view.recv_x.data_ptr() == ep.buffers.recv_x.data_ptr() and cap < ep.buffers.capacity  # a view
    with ep.pin(ep.agree_step(hi - lo, [])):  # the engine's agreement sizes the same
        ep.begin_forward(hi - lo)
        assert ep.step_buffers is view
    args = (x[lo:hi], w[lo:hi], idx[lo:hi], local_experts(experts, placement, rank), shared, LIMIT, placement)
    moved, saved = RowsMoved(), ep_dispatch.dist
    ep_dispatch.dist = moved
    try:
        got = ep_moe_experts(*args, buffers=view)
    finally:
        ep_dispatch.dist = saved
    assert moved.rows == [world * cap] * 3  # rows, metadata, outputs back
    assert torch.equal(got, want[lo:hi]) and torch.equal(got, ep_moe_experts(*args, buffers=ep.buffers))


def _worker(rank: int, world: int, init: str, cases: list) -> None:
    torch.set_num_threads(1)
    groups.init_group(rank, world, init, "cpu", timeout_s=60)
    try:
        check_agree_step(rank, world)
        check_bucketed_capacity(rank, world)
        for case in cases:
            run_case(rank, world, *case)
    finally:
        groups.destroy()


def spawn(world: int, tmp_path, cases: list) -> None:
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/rendezvous", cases), nprocs=world, join=True)


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(120)
def test_ep_two_ranks_equals_single_process(tmp_path):
    plain = ExpertPlacement.initial(N_EXP, 2)
    spawn(2, tmp_path, [
        ([0, 13], plain, torch.float32, 0),  # rank 0 has no tokens
        ([7, 6], plain, torch.bfloat16, 1),
        ([9, 0], plain, torch.float32, 2, True),  # FP4 experts as stored
    ])


@pytest.mark.timeout(120)
def test_static_capacity_dispatch_two_ranks_equals_single_process(tmp_path):
    """The fast-tier case: fixed-size buffers, a rank with no tokens, the per-peer worst case, FP4 as stored."""
    spawn(2, tmp_path, [
        ([0, 13], ExpertPlacement.initial(N_EXP, 2), torch.float32, 0, False, True),
        ([7, 6], ExpertPlacement.initial(N_EXP, 2, min_extra=2), torch.bfloat16, 1, False, True),
        ([9, 2], ExpertPlacement.initial(N_EXP, 2), torch.float32, 2, True, True),
    ])


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(120)
def test_static_capacity_dispatch_four_ranks_with_redundant_copies(tmp_path):
    shuffled = ExpertPlacement.from_ranks([[7, 1, 3], [0, 7, 4], [2, 6, 7], [3, 5, 0]], N_EXP)
    spawn(4, tmp_path, [
        ([5, 0, 9, 3], ExpertPlacement.initial(N_EXP, 4), torch.float32, 3, False, True),
        ([6, 3, 0, 8], shuffled, torch.bfloat16, 5, False, True),
    ])


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(120)
def test_ep_four_ranks_equals_single_process(tmp_path):
    plain = ExpertPlacement.initial(N_EXP, 4)
    spawn(4, tmp_path, [
        ([5, 0, 9, 3], plain, torch.float32, 3),
        ([4, 6, 0, 2], plain, torch.bfloat16, 4),
    ])


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(120)
def test_ep_redundant_placement_equals_single_process(tmp_path):
    # 8 logical experts on 12 physical slots: hot experts 0, 3 and 7 replicated (7 three times), shuffled over ranks
    shuffled = ExpertPlacement.from_ranks([[7, 1, 3], [0, 7, 4], [2, 6, 7], [3, 5, 0]], N_EXP)
    from_eplb = rebalance(torch.tensor([900.0, 50, 0, 400, 30, 0, 20, 700]), num_ranks=4, num_redundant=4).placement
    assert from_eplb.num_physical == 12 and from_eplb != ExpertPlacement.initial(N_EXP, 4, 4)
    spawn(4, tmp_path, [
        ([6, 3, 0, 8], shuffled, torch.float32, 5),
        ([3, 3, 3, 3], shuffled, torch.bfloat16, 6),
        ([2, 0, 7, 4], ExpertPlacement.initial(N_EXP, 4, min_extra=2), torch.float32, 7),  # 8 + 4 slots
        ([5, 4, 3, 0], from_eplb, torch.float32, 8),
    ])


# ---- single-process checks ---------------------------------------------------------------------------------------


def test_accumulation_order_matters_on_this_data():
    """The bitwise comparison above can fail: summing a token's experts in another order changes the fp32 result
    on the test data, so an EP combine that did not follow the op's order would be caught."""
    x, w, idx, experts, shared = problem(0, 13, torch.float32)
    want = moe_experts(x, w, idx, experts, shared, LIMIT)
    from deepinfer.kernels.torch.moe import swiglu_expert

    y = torch.zeros(x.shape)
    for e in sorted(torch.unique(idx).tolist(), reverse=True):
        rows, slot = torch.where(idx == e)
        y[rows] += swiglu_expert(x[rows], *experts[e], LIMIT, w[rows, slot, None]).float()
    y += swiglu_expert(x, *shared, LIMIT).float()
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5) and not torch.equal(y, want)


def test_meta_packing_round_trips_exactly():
    slot = torch.tensor([0, 1, 5, 1023])
    w = torch.tensor([0.1, -2.5, 1e-30, float("inf")])
    s, v = _unpack(_pack(slot, w))
    assert torch.equal(s, slot) and torch.equal(v.view(torch.int32), w.view(torch.int32))
    s, v = _unpack(torch.tensor([UNUSED_META]))  # an unused row of the static buffers: no expert, weight 0
    assert s.tolist() == [-1] and v.view(torch.int32).tolist() == [0]


def test_copies_spread_over_replicas_and_cover_only_owned_slots():
    pl = ExpertPlacement.from_ranks([[7, 1, 3], [0, 7, 4], [2, 6, 7], [3, 5, 0]], N_EXP)
    idx = torch.tensor([[7, 0, 3]] * 6)
    phys = choose_copies(idx, pl, src_rank=1)
    assert [pl.physical_to_logical[p] for p in phys.reshape(-1).tolist()] == idx.reshape(-1).tolist()
    assert set(phys[:, 0].tolist()) == {0, 4, 8}  # expert 7's three copies all used
    assert set(phys[:, 1].tolist()) == {3, 11}


def test_placement_rejects_bad_maps():
    with pytest.raises(ValueError, match="no physical slot"):
        ExpertPlacement.from_ranks([[0, 1], [1, 2]], 4)
    with pytest.raises(ValueError, match="divide"):
        ExpertPlacement(tuple(range(5)), 5, 2)
    assert ExpertPlacement.initial(384, 8, 0).per_rank == 48
    assert ExpertPlacement.initial(384, 8, 1).num_physical == 392  # rounded up to a multiple of 8 (DeepInfer)


def test_static_buffers_hold_the_worst_case_per_peer_and_place_rows_in_order():
    # a token sends at most min(top_k, slots per rank) rows to one peer
    assert capacity_rows(max_tokens=256, top_k=6, per_rank=48) == 1536
    assert capacity_rows(max_tokens=4, top_k=6, per_rank=2) == 8
    b = StaticBuffers.allocate(4, 3, 4, 2, D, torch.bfloat16, "cpu")
    assert b.capacity == 12 and b.recv_x.shape == (24, D) and b.send_x.shape == (24, D)
    assert b.fits(4) and not b.fits(5)
    dest = torch.tensor([1, 0, 1, 1, 0])
    assert send_rows(dest, 2, 12).tolist() == [12, 0, 13, 14, 1]  # each peer's rows at the front of its segment


def test_a_step_uses_views_of_the_buffers_sized_for_its_bucket():
    b = StaticBuffers.allocate(8, 3, 4, 2, D, torch.bfloat16, "cpu")
    assert [b.bucket(t) for t in (0, 1, 3, 8, 9)] == [1, 1, 3, 8, 0]  # no buckets: the tokens themselves
    with pytest.raises(ValueError, match="the largest 8"):
        b.set_buckets([1, 2, 4])
    b.set_buckets([4, 1, 8, 2])
    assert b.buckets == (1, 2, 4, 8) and [b.bucket(t) for t in (0, 1, 3, 5, 8, 9)] == [1, 1, 4, 8, 8, 0]
    v = b.at(2)
    assert (v.max_tokens, v.capacity, v.world) == (2, 6, 2) and v is b.at(2) and b.at(8) is b
    for name in ("send_x", "recv_x", "send_meta", "recv_meta", "back"):
        part, whole = getattr(v, name), getattr(b, name)
        assert part.shape[0] == 12 and part.data_ptr() == whole.data_ptr() and part.is_contiguous()
    assert v.fits(2) and not v.fits(3)
    with pytest.raises(ValueError, match="hold 1..8"):
        b.at(9)


def test_static_path_refuses_a_step_larger_than_its_buffers():
    """An overflow is never dropped: a step that does not fit must have been sent down the variable path, and a
    forward larger than the capacity its ranks agreed (a view) is refused too."""
    x, w, idx, experts, shared = problem(0, 5, torch.float32)
    pl = ExpertPlacement.initial(N_EXP, 1)
    b = StaticBuffers.allocate(4, TOP_K, pl.per_rank, 1, D, x.dtype, "cpu")
    groups.init_group(0, 1, f"file://{tempfile.mkdtemp()}/rendezvous", "cpu", timeout_s=30)
    try:
        assert not agree_static(b, 5, None)
        with pytest.raises(ValueError, match="5 tokens on the static path"):
            ep_moe_experts(x, w, idx, experts, shared, LIMIT, pl, buffers=b)
        with pytest.raises(ValueError, match="4 tokens on the static path, whose buffers hold 2"):
            ep_moe_experts(x[:4], w[:4], idx[:4], experts, shared, LIMIT, pl, buffers=b.at(2))
        ep = ExpertParallel(pl, 0)
        ep.plan_static(4, TOP_K, D, x.dtype, "cpu")
        with ep.pin(StepPath(True, 0, 2)), pytest.raises(ValueError, match="3 tokens under a pinned static path"):
            ep.begin_forward(3)
        # one rank owning every expert: both paths equal the op
        want = moe_experts(x, w, idx, experts, shared, LIMIT)
        assert torch.equal(ep_moe_experts(x, w, idx, experts, shared, LIMIT, pl), want)
        assert torch.equal(ep_moe_experts(x[:4], w[:4], idx[:4], experts, shared, LIMIT, pl, buffers=b), want[:4])
        assert torch.equal(ep_moe_experts(x[:2], w[:2], idx[:2], experts, shared, LIMIT, pl, buffers=b.at(2)),
                           want[:2])
    finally:
        groups.destroy()
