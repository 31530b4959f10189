"""EPLB at run time (deepinfer/distributed/eplb_runtime.py, expert_move.py) on the embedded tiny model over gloo: the
counts the MoE step records, re-placement during a run (prefill, then decode steps re-placed between them) with the
logits bitwise equal to the single-process model, the weights moved between ranks equal to the checkpoint's, the
imbalance falling on a skewed routing and the log line; and the move plan on its own (one process)."""

from __future__ import annotations

import json
import logging
import random
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deepinfer.models.deepseek_v41 as dsv
from deepinfer import embedded
from deepinfer.models import load_model
from deepinfer.models.batch import ForwardBatch
from deepinfer.distributed import groups
from deepinfer.distributed.eplb_runtime import EplbRuntime, skewed_imbalance_report
from deepinfer.distributed.expert_move import align, plan_moves, slot_tensors, transfers
from deepinfer.distributed.placement import ExpertPlacement

N_EXP, TOP_K, STEPS = 8, 2, 4  # the tiny model: 8 routed experts, top-2; decode steps after the prefill
LINE = re.compile(r"\[EPLB\] step (\d+): re-placed 8 MoE layers, (\d+) physical experts \((\d+) redundant\) on (\d+) "
                  r"ranks \((\d+) each\) from the token counts of the last (\d+) steps?: imbalance \(max/mean rank "
                  r"load\) ([\d.]+) -> ([\d.]+); (\d+) experts moved between ranks \(([\d.]+) MB\), [\d.]+ s")


def prompts(seed: int, lengths: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and, per decode step, one fixed next token per prompt (the EP run and the reference follow the same
    tokens whatever they compute)."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    return ps, [torch.randint(3, 500, (len(lengths),), generator=g).tolist() for _ in range(STEPS)]


def skew(model, hot: dict[int, float]) -> None:
    """A skewed routing: the router's selection bias raised for the `hot` experts in every layer."""
    for lw in model.layers:
        for e, b in hot.items():
            lw.ffn.gate.bias[e] += b


def reference(model_dir, packed: bool, hot: dict[int, float], lengths: list[int], seed: int):
    """Single-process logits (prefill over every prompt token, then each decode step) and the model's experts."""
    model = load_model(model_dir, draft_layers=False, packed_experts=packed)
    skew(model, hot)
    ps, steps = prompts(seed, lengths)
    states = [model.new_state() for _ in ps]
    want = [model.forward(ForwardBatch(ps, states, all_logits=True))]
    want += [model.forward(ForwardBatch([[t] for t in toks], states)) for toks in steps]
    return want, [lw.ffn.experts for lw in model.layers]


def _worker(rank, world, init, model_dir, placement, packed, hot, split, lengths, seed, eplb, want, full, out):
    torch.set_num_threads(1)
    group = groups.init_group(rank, world, init, "cpu", timeout_s=90)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logging.getLogger("deepinfer.eplb").addHandler(handler)
    logging.getLogger("deepinfer.eplb").setLevel(logging.INFO)
    routed: list[torch.Tensor] = []  # this rank's router choices, one per MoE call (layers in order)
    real = dsv.ep_moe_experts

    def spy(x, weights, idx, *args, **kw):
        routed.append(torch.bincount(idx.reshape(-1), minlength=N_EXP))
        return real(x, weights, idx, *args, **kw)

    dsv.ep_moe_experts = spy
    try:
        model = load_model(model_dir, expert_placement=placement, ep_rank=rank, ep_group=group, draft_layers=False,
                           packed_experts=packed)
        skew(model, hot)
        rt = EplbRuntime(model, *eplb)
        ps, steps = prompts(seed, lengths)
        lo, hi = sum(split[:rank]), sum(split[:rank + 1])
        states = [model.new_state() for _ in range(lo, hi)]
        got, recs, counts_at = [], [], {}
        batches = [ForwardBatch(ps[lo:hi], states, all_logits=True)]
        batches += [ForwardBatch([[t] for t in toks[lo:hi]], states) for toks in steps]
        for batch in batches:
            got.append(model.forward(batch))
            rec = rt.after_step()
            if rec is not None:
                recs.append(rec)
                counts_at[rec.step] = rt.last_counts
        row0 = sum(lengths[:lo])
        rows = [(row0, row0 + sum(lengths[lo:hi]))] + [(lo, hi)] * STEPS
        for step, (g, w, (a, b)) in enumerate(zip(got, want, rows)):
            assert torch.equal(g, w[a:b]), f"rank {rank} step {step}: max |diff| {(g - w[a:b]).abs().max().item()}"

        # what was measured: per layer and logical expert, the tokens every rank's router sent there in the window
        n_layers = len(model.layers)
        chosen = torch.stack(routed).view(len(batches), n_layers, N_EXP)
        dist.all_reduce(chosen)
        for step, counts in counts_at.items():
            window = chosen[max(0, step - eplb[1]):step].sum(0)
            assert torch.equal(counts.sum(0), window), f"rank {rank}: counts read at step {step}"

        # every slot holds, byte for byte, the checkpoint's weights of the expert its layer's placement gives it
        ep = model.expert_parallel
        new_here = 0
        for i, lw in enumerate(model.layers):
            mine = ep.layer_placements[i].local_logical(rank)
            for j, e in enumerate(mine):
                for a, b in zip(slot_tensors(lw.ffn.experts, j), slot_tensors(full[i], e)):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (rank, i, j, e)
            new_here += len(set(mine) - set(placement.local_logical(rank)))
        summary = {"rank": rank, "lines": lines, "new_experts": new_here,
                   "recs": [[r.step, r.imbalance_before, r.imbalance_after, r.moved, r.moved_bytes] for r in recs]}
        (out / f"rank{rank}.json").write_text(json.dumps(summary))
    finally:
        dsv.ep_moe_experts = real
        groups.destroy()


def run_eplb(tmp_path, placement, packed, hot, split, lengths, seed, eplb) -> list[dict]:
    model_dir = embedded.materialize("tiny-random")
    want, full = reference(model_dir, packed, hot, lengths, seed)
    mp.spawn(_worker, args=(placement.num_ranks, f"file://{tmp_path}/rendezvous", str(model_dir), placement, packed,
                            hot, split, lengths, seed, eplb, want, full, tmp_path),
             nprocs=placement.num_ranks, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(placement.num_ranks)]


def check_log(results: list[dict], expect_steps: list[int]) -> list[re.Match]:
    """One line per re-placement, on rank 0 only, with the numbers every rank computed."""
    assert all(not r["lines"] for r in results[1:])
    matches = [LINE.fullmatch(line) for line in results[0]["lines"]]
    assert all(matches) and [int(m.group(1)) for m in matches] == expect_steps, results[0]["lines"]
    for m, rec in zip(matches, results[0]["recs"]):
        assert (float(m.group(7)), float(m.group(8))) == (round(rec[1], 3), round(rec[2], 3))
        assert int(m.group(9)) == rec[3] and float(m.group(10)) == round(rec[4] / 1e6, 2)
    assert all(r["recs"] == results[0]["recs"] for r in results)
    return matches


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(240)
def test_replacement_during_run_two_ranks_bitwise(tmp_path):
    """2 ranks, dense experts, 2 redundant slots (0 and 7 on both ranks, the rest shuffled), the model's own routing;
    re-placed after steps 1, 3, 5 (interval 2: the first after max(1, 2 // 4) = 1 step), window 2."""
    placement = ExpertPlacement.from_ranks([[7, 1, 3, 0, 5], [0, 7, 4, 2, 6]], N_EXP)
    results = run_eplb(tmp_path, placement, False, {}, [2, 3], [11, 4, 7, 20, 6], 1, (2, 2, 2))
    check_log(results, [1, 3, 5])
    assert sum(rec[3] for rec in results[0]["recs"]) > 0  # weights did move between ranks


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(300)
def test_skewed_routing_four_ranks_fp4(tmp_path):
    """4 ranks, FP4 experts as stored, 4 redundant slots, experts 4 and 5 made hot (both on rank 1 in the initial
    layout): the imbalance falls, the new owners of 4 and 5 hold the checkpoint's bytes, the logits stay exact."""
    placement = ExpertPlacement.initial(N_EXP, 4, 4)  # [0 1 2] [3 4 5] [6 7 0] [1 2 3]
    results = run_eplb(tmp_path, placement, True, {4: 1.0, 5: 0.8}, [2, 1, 1, 2], [9, 14, 5, 3, 12, 8], 2,
                       (4, 4, 4))
    # interval 4: after max(1, 4 // 4) = 1 step (the prefill), then 4 steps later
    m = check_log(results, [1, 5])[0]
    before, after = float(m.group(7)), float(m.group(8))
    assert before > 2.0 and after < 1.5 and after < before, (before, after)
    assert sum(r["new_experts"] for r in results) >= 4  # copies of 4 and 5 on ranks that held neither


# ---- one process ---------------------------------------------------------------------------------------------


def _simulate(old: ExpertPlacement, new: ExpertPlacement) -> list[list[int]]:
    """Run every rank's plan on slot contents (expert ids), messages matched by (sender, receiver, expert)."""
    held = old.per_rank_lists()
    plans = [plan_moves(old, new, r) for r in range(old.num_ranks)]
    sent = {(r, dst, e): held[r][slot] for r, p in enumerate(plans) for dst, e, slot in p.sends}
    out = []
    for r, p in enumerate(plans):
        staging = {}
        for slot, row in p.copies:
            staging[row] = held[r][slot]
        for src, e, row in p.recvs:
            staging[row] = sent.pop((src, r, e))
        slots = list(held[r])
        for slot, row in p.fills:
            slots[slot] = staging[row]
        out.append(slots)
    assert not sent, f"sent but never received: {sent}"
    return out


def test_move_plan_reaches_the_new_placement():
    rng = random.Random(0)
    for ranks, logical, extra in ((2, 8, 2), (4, 8, 4), (4, 16, 0), (8, 24, 8)):
        old = ExpertPlacement.initial(logical, ranks, extra)
        for _ in range(20):
            flat = list(range(logical)) + [rng.randrange(logical) for _ in range(extra)]
            rng.shuffle(flat)
            new = ExpertPlacement(tuple(flat), logical, ranks)
            assert _simulate(old, new) == new.per_rank_lists()
            aligned = align(old, new)
            assert sorted(map(sorted, aligned.per_rank_lists())) == sorted(map(sorted, new.per_rank_lists()))
            assert _simulate(old, aligned) == aligned.per_rank_lists()
            assert transfers(old, aligned) <= transfers(old, new)
            old = new


def test_align_keeps_a_relabelled_placement_in_place():
    old = ExpertPlacement.from_ranks([[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]], N_EXP)
    shuffled = ExpertPlacement.from_ranks([[3, 2, 1], [0, 7, 6], [5, 3, 4], [2, 0, 1]], N_EXP)
    assert align(old, shuffled) == old and transfers(old, shuffled) == 8 and transfers(old, align(old, shuffled)) == 0
    assert all(not (p.sends or p.rows) for p in (plan_moves(old, old, r) for r in range(4)))


def test_skewed_imbalance_report_small():
    rep = skewed_imbalance_report(num_experts=16, num_ranks=4, redundant_experts=4, top_k=2, tokens_per_rank=16,
                                  steps=8, layers=2, zipf=1.5, seed=0)
    assert rep["policy_after"] < rep["policy_before"] and rep["dispatched_after"] < rep["dispatched_before"]
    assert f"{rep['policy_before']:.3f} -> {rep['policy_after']:.3f} (policy)" in rep["log_line"]


def test_runtime_settings_are_checked():
    model_dir = embedded.materialize("tiny-random")
    plain = ExpertPlacement.initial(N_EXP, 2)
    model = load_model(model_dir, expert_placement=plain, ep_rank=0, draft_layers=False)
    with pytest.raises(ValueError, match=r"eplb.window=5 must be between 1 and eplb.interval=4"):
        EplbRuntime(model, 0, 5, 4)
    with pytest.raises(ValueError, match=r"eplb.redundant_experts=2 gives 2 redundant slots on 2 ranks; the model "
                                         r"was loaded with 0: load it with ExpertPlacement.initial\(8, 2, 2\)"):
        EplbRuntime(model, 2, 4, 4)
    with pytest.raises(ValueError, match=r"eplb.interval=-1"):
        EplbRuntime(model, 0, 0, -1)
    off = EplbRuntime(model, 0, 100, 0)  # interval 0: nothing installed, nothing counted, no collective
    assert not off.enabled and off.after_step() is None and model.expert_parallel.load is None
    with pytest.raises(ValueError, match="expert-parallel model"):
        EplbRuntime(load_model(model_dir, draft_layers=False), 0, 1, 1)
