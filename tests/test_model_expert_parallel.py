"""Expert parallelism inside the model (issue 13 item 3): `load_model(expert_placement=..., ep_rank=...)` reads only
the rank's routed experts from the checkpoint, and the model's MoE layers run `ep_moe_experts` over a gloo group.
On the CPU, 2 spawned processes each running a *different* batch (prefill, then decode steps) give logits bitwise
equal to the single-process model over all the prompts at once: plain and redundant (replicated, shuffled)
placements, FP4 experts as stored, and a rank with one token while the other has many; with static-capacity
dispatch buffers the decode steps take the static path and the prefill the variable one."""

from __future__ import annotations

import logging
import re
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer import embedded
from deepinfer.models import load_model
from deepinfer.models.batch import ForwardBatch
from deepinfer.models.loading.names import canonical_name
from deepinfer.models.loading.safetensors_reader import SafetensorsFiles
from deepinfer.distributed import groups
from deepinfer.distributed.placement import ExpertPlacement

N_EXP = 8  # the embedded tiny model: 8 routed experts, top-2
STEPS = 3  # decode steps after the prefill
ROUTED = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.")
# 8 logical experts on 10 slots: 0 and 7 on both ranks, the rest shuffled
REDUNDANT = ExpertPlacement.from_ranks([[7, 1, 3, 0, 5], [0, 7, 4, 2, 6]], N_EXP)


def prompts(seed: int, lengths: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of the given lengths and, per decode step, one next token per prompt (fixed, not sampled: the
    EP run and the reference follow the same tokens whatever they compute)."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    steps = [torch.randint(3, 500, (len(lengths),), generator=g).tolist() for _ in range(STEPS)]
    return ps, steps


def run(model, ps: list[list[int]], steps: list[list[int]], paths: list | None = None) -> list[torch.Tensor]:
    """Logits of the prefill (every prompt token) and of each decode step; `paths` gets whether each step's MoE
    layers took the static-capacity dispatch (expert parallel)."""
    states = [model.new_state() for _ in ps]
    out = [model.forward(ForwardBatch(ps, states, all_logits=True))]
    for toks in [None] + steps:
        if toks is not None:
            out.append(model.forward(ForwardBatch([[t] for t in toks], states)))
        if paths is not None:
            paths.append(model.expert_parallel.static)
    return out


def _worker(rank: int, world: int, init: str, model_dir: str, placement, packed: bool, split: list[int],
            lengths: list[int], seed: int, want: list[torch.Tensor], max_tokens: int) -> None:
    torch.set_num_threads(1)
    group = groups.init_group(rank, world, init, "cpu", timeout_s=60)
    try:
        model = load_model(model_dir, expert_placement=placement, ep_rank=rank, ep_group=group, draft_layers=False,
                           packed_experts=packed, ep_max_tokens=max_tokens)
        assert model.expert_parallel.rank == rank
        assert all((lw.ffn.experts.n_experts if packed else len(lw.ffn.experts)) == placement.per_rank
                   for lw in model.layers)
        ps, steps = prompts(seed, lengths)
        lo, hi = sum(split[:rank]), sum(split[:rank + 1])  # this rank's prompts: [lo, hi) of the global list
        paths: list[bool] = []
        got = run(model, ps[lo:hi], [s[lo:hi] for s in steps], paths)
        # with static buffers for max(split) tokens: the prefill takes the variable path, the decode steps the static
        assert paths == ([False] + [True] * STEPS if max_tokens else [False] * (STEPS + 1)), paths
        row0 = sum(lengths[:lo])
        rows = [(row0, row0 + sum(lengths[lo:hi]))] + [(lo, hi)] * STEPS
        for step, (g, w, (a, b)) in enumerate(zip(got, want, rows)):
            assert g.shape == (b - a, w.shape[1])
            assert torch.equal(g, w[a:b]), (
                f"rank {rank} step {step}: max |diff| {(g - w[a:b]).abs().max().item()}")
    finally:
        groups.destroy()


def check_ep(tmp_path, placement: ExpertPlacement, split: list[int], lengths: list[int], seed: int,
             packed: bool = False, max_tokens: int = 0) -> None:
    """The single-process model over all prompts in one batch, then 2 ranks each running its own slice
    (`max_tokens` > 0: with static dispatch buffers for that many tokens per rank)."""
    model_dir = embedded.materialize("tiny-random")
    ps, steps = prompts(seed, lengths)
    want = run(load_model(model_dir, draft_layers=False, packed_experts=packed), ps, steps)
    mp.spawn(_worker, args=(placement.num_ranks, f"file://{tmp_path}/rendezvous", str(model_dir), placement, packed,
                            split, lengths, seed, want, max_tokens), nprocs=placement.num_ranks, join=True)


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(180)
def test_ep_model_two_ranks_equals_single_process(tmp_path):
    # rank 0: 3 prompts, rank 1: 2 others of other lengths
    check_ep(tmp_path, ExpertPlacement.initial(N_EXP, 2), [3, 2], [5, 17, 9, 12, 3], seed=0)


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(180)
def test_ep_model_redundant_experts_fp4_as_stored(tmp_path):
    check_ep(tmp_path, REDUNDANT, [2, 3], [11, 4, 7, 20, 6], seed=1, packed=True, max_tokens=3)


@pytest.mark.slow  # spawned ranks: the fast tier keeps the dep2 and cp2 engine runs
@pytest.mark.timeout(180)
def test_ep_model_one_token_rank_against_many(tmp_path):
    # rank 0: one sequence of one token (then one token per decode step); rank 1: six prompts, 82 tokens
    check_ep(tmp_path, ExpertPlacement.initial(N_EXP, 2), [1, 6], [1, 13, 21, 4, 16, 9, 19], seed=2, max_tokens=6)


# ---- per-rank loading (one process, no group needed) -------------------------------------------------------------


def _reads(monkeypatch) -> Counter:
    """Canonical names of every tensor the loader reads from the files (weights and scales), with counts."""
    seen: Counter = Counter()
    rows = SafetensorsFiles.rows

    def spy(self, t, start=None, stop=None):
        seen[canonical_name(t.key)] += 1
        return rows(self, t, start, stop)

    monkeypatch.setattr(SafetensorsFiles, "rows", spy)
    return seen


@pytest.mark.timeout(180)
def test_rank_reads_only_its_experts(monkeypatch, caplog):
    model_dir = embedded.materialize("tiny-random")
    full_reads = _reads(monkeypatch)
    full = load_model(model_dir, draft_layers=False, packed_experts=True)
    monkeypatch.undo()
    for rank in range(2):
        reads = _reads(monkeypatch)
        with caplog.at_level(logging.INFO, logger="deepinfer.loading"):
            model = load_model(model_dir, expert_placement=REDUNDANT, ep_rank=rank, draft_layers=False,
                               packed_experts=True)
        monkeypatch.undo()
        local = REDUNDANT.local_logical(rank)
        n_layers = model.config.num_hidden_layers
        read_experts = {(int(m.group(1)), int(m.group(2))) for n in reads if (m := ROUTED.match(n))}
        assert read_experts == {(i, e) for i in range(n_layers) for e in set(local)}
        # everything that is not another rank's routed expert is read exactly as in the full load, each tensor once
        assert reads == Counter({n: c for n, c in full_reads.items()
                                 if (m := ROUTED.match(n)) is None or int(m.group(2)) in local})
        assert set(reads.values()) == {1}
        assert any(".ffn.shared_experts." in n for n in reads) and "embed.weight" in reads
        # slot j holds logical expert local[j], bit for bit the full model's (a redundant copy: the same bytes)
        for lw, fw in zip(model.layers, full.layers):
            assert lw.ffn.experts.n_experts == REDUNDANT.per_rank
            for j, e in enumerate(local):
                for a, b in zip(lw.ffn.experts.dense(j, torch.float32), fw.ffn.experts.dense(e, torch.float32)):
                    assert torch.equal(a, b)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"expert parallel rank {rank} ")]
        assert len(lines) == 1 and "5 of 10 physical expert slots" in lines[0] and "GB" in lines[0], lines
        caplog.clear()


def test_draft_layers_load_whole_on_every_expert_parallel_rank():
    """DSpark under expert parallelism: the backbone's experts are sharded, the draft layers' are replicated."""
    model_dir = embedded.materialize("tiny-random")
    model = load_model(model_dir, expert_placement=ExpertPlacement.initial(N_EXP, 2), ep_rank=1)
    assert all(len(lw.ffn.experts) == 4 for lw in model.layers)
    assert model.drafter is not None
    assert all(len(lw.ffn.experts) == model.config.dspark_n_routed_experts for lw in model.drafter.w.layers)


def test_expert_parallel_load_refusals():
    model_dir = embedded.materialize("tiny-random")
    plain = ExpertPlacement.initial(N_EXP, 2)
    with pytest.raises(ValueError, match="16 logical experts; the model has n_routed_experts=8"):
        load_model(model_dir, expert_placement=ExpertPlacement.initial(16, 2), draft_layers=False)
    with pytest.raises(ValueError, match=r"ep_rank=2 is out of range; allowed: 0\.\.1"):
        load_model(model_dir, expert_placement=plain, ep_rank=2, draft_layers=False)
