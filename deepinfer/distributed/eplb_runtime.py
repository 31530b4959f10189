"""EPLB at run time (issue 13 item 4): measure each MoE layer's expert load, and every `interval` steps re-place the
experts from it (redundant copies to the hottest, copies spread over the ranks) and move the weights.

Follows DeepInfer 0.1.0 `deepinfer/model_executor/eplb/__init__.py` (ExpertLoadBalancer):
  - what is measured: per MoE layer, the token rows each local physical slot computed in a step (DeepInfer: the
    per-local-expert receive counts of the dispatch), added on the device inside the MoE step to a preallocated
    [layers, slots per rank] buffer (`ExpertParallel.load`; no host read, no allocation for it per step);
  - `window`: after each step the buffer goes into a ring of the last `window` steps' counts and is zeroed;
  - `interval` (0 = off): the first re-placement after max(1, interval // 4) steps (DeepInfer moves it forward to
    correct the cold start early), then every `interval` steps; 1 <= window <= interval when on, so the counts a
    re-placement reads were all taken under the placement it replaces (each slot's count is mapped to its expert
    through that placement);
  - at a re-placement: the ring mapped to [window, layers, logical experts] and all-reduced (sum) over the EP
    group; the greedy policy (deepinfer.distributed.eplb.rebalance) per layer on the per-step counts; the weights
    moved (deepinfer.distributed.expert_move: batched point-to-point, see there why); the dispatch tables rewritten
    in place; one log line on rank 0 with the imbalance (max / mean rank load over the window) before and after.
  - `redundant_experts` (DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS): the minimum redundant physical slots, rounded up so
    the slots divide over the ranks; the model must have been loaded with that placement
    (`ExpertPlacement.initial(n_routed_experts, ranks, redundant_experts)`): the slots per rank never change.
Where this differs: DeepInfer's normal engine leaves prefill steps out of the window and the step count
(DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE); here every model step counts, because our ranks' steps mix
prefill chunks and decodes and a per-rank "is prompt" flag would differ between ranks and desynchronise the
collectives. The policy runs on rank 0 and the maps are broadcast, so every rank applies the same placement even
where floating-point sums could differ between hosts. DeepInfer re-places with the same placement for all layers of
one layout group; here every backbone MoE layer has its own (draft layers are not expert parallel yet).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .eplb import rank_loads, rebalance
from .expert_move import align, move_experts, own_slots, plan_moves, slot_bytes, transfers
from .expert_parallel import choose_copies, replica_table
from .placement import ExpertPlacement, resolve_num_extra_experts

log = logging.getLogger("deepinfer.eplb")


@dataclass(frozen=True)
class Replan:
    placements: tuple[ExpertPlacement, ...]  # per layer, aligned to the current ones
    imbalance_before: float
    imbalance_after: float
    moved: int  # experts received across ranks, summed over layers


def imbalance_over_layers(counts: torch.Tensor, placements: Sequence[ExpertPlacement]) -> float:
    """counts [W, L, E]: Σ_{steps, layers} max rank load / Σ_{steps, layers} mean rank load (1.0 = balanced)."""
    peak = mean = 0.0
    for i, p in enumerate(placements):
        loads = rank_loads(counts[:, i].to(torch.float64), p)  # [W, R]
        peak += loads.max(dim=1).values.sum().item()
        mean += loads.mean(dim=1).sum().item()
    return peak / mean if mean > 0 else 1.0


def replan(counts: torch.Tensor, current: Sequence[ExpertPlacement]) -> Replan:
    """counts [W, L, E] tokens per step, layer and logical expert -> each layer's new placement by the greedy policy
    (the same numbers of ranks and redundant slots), aligned to move as few weights as possible."""
    if counts.dim() != 3 or counts.shape[1] != len(current):
        raise ValueError(f"counts must be [window, {len(current)} layers, experts]; got {tuple(counts.shape)}")
    new = []
    for i, p in enumerate(current):
        out = rebalance(counts[:, i], p.num_ranks, p.num_physical - p.num_logical, current=p)
        new.append(align(p, out.placement))
    return Replan(tuple(new), imbalance_over_layers(counts, current), imbalance_over_layers(counts, new),
                  sum(transfers(a, b) for a, b in zip(current, new)))


@dataclass(frozen=True)
class Replacement:
    """One re-placement, as every rank saw it."""

    step: int
    layers: int
    placement: ExpertPlacement  # layer 0's new placement (the shape of all)
    window_steps: int
    imbalance_before: float
    imbalance_after: float
    moved: int
    moved_bytes: int
    seconds: float

    def log_line(self) -> str:
        p, w = self.placement, self.window_steps
        return (f"[EPLB] step {self.step}: re-placed {self.layers} MoE layers, {p.num_physical} physical experts "
                f"({p.num_physical - p.num_logical} redundant) on {p.num_ranks} ranks ({p.per_rank} each) from the "
                f"token counts of the last {w} step{'s' * (w != 1)}: imbalance (max/mean rank load) "
                f"{self.imbalance_before:.3f} -> {self.imbalance_after:.3f}; {self.moved} experts moved between "
                f"ranks ({self.moved_bytes / 1e6:.2f} MB), {self.seconds:.3f} s")


class EplbRuntime:
    """EPLB for an expert-parallel model (load_model(expert_placement=..., ep_rank=..., ep_group=...)). Plain ints,
    as conf/parallel eplb.{redundant_experts, window, interval} (DeepInfer: DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS,
    DEEPINFER_EXPERT_COUNT_WINDOW_SIZE, DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL). `group`: the EP group (None:
    the model's). Every rank calls `after_step()` once after each model forward (dummy steps included): a
    re-placement is a set of collectives. With interval 0 or one rank it does nothing and counts nothing."""

    def __init__(self, model, redundant_experts: int, window: int, interval: int,
                 group: dist.ProcessGroup | None = None):
        ep = model.expert_parallel
        if ep is None:
            raise ValueError("EPLB needs an expert-parallel model: load_model(expert_placement=..., ep_rank=...)")
        for name, v in (("redundant_experts", redundant_experts), ("window", window), ("interval", interval)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"eplb.{name}={v!r}; allowed: an integer >= 0")
        if interval and not 1 <= window <= interval:
            raise ValueError(f"eplb.window={window} must be between 1 and eplb.interval={interval} when re-placement "
                             "is on (the counts a re-placement reads must all come from the placement it replaces)")
        placement = ep.placement
        num_logical = model.config.n_routed_experts
        extra = resolve_num_extra_experts(num_logical, redundant_experts, placement.num_ranks)
        if placement.num_physical != num_logical + extra:
            raise ValueError(
                f"eplb.redundant_experts={redundant_experts} gives {extra} redundant slots on {placement.num_ranks} "
                f"ranks; the model was loaded with {placement.num_physical - num_logical}: load it with "
                f"ExpertPlacement.initial({num_logical}, {placement.num_ranks}, {redundant_experts})")
        self.model, self.window, self.interval = model, window, interval
        self.group = ep.group if group is None else group
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self.steps = 0
        self.last: Replacement | None = None
        self.last_counts: torch.Tensor | None = None  # [window, L, E] the last re-placement read (CPU)
        self.enabled = interval > 0 and placement.num_ranks > 1
        if not self.enabled:
            return
        layers, dev = len(model.layers), model.device
        self._width = extra + 1  # the most copies one expert can get: all redundant slots
        for lw in model.layers:
            own_slots(lw.ffn.experts)  # each slot overwritable on its own
        table, copies = replica_table(placement, self._width)
        ep.replicas = table.to(dev).unsqueeze(0).repeat(layers, 1, 1)
        ep.copies = copies.to(dev).unsqueeze(0).repeat(layers, 1)
        ep.load = torch.zeros(layers, placement.per_rank, dtype=torch.int64, device=dev)
        ep.layer_placements = [placement] * layers
        self._ring = torch.zeros(window, layers, placement.per_rank, dtype=torch.int64, device=dev)
        self._row = 0
        local = torch.tensor(placement.local_logical(self.rank), dtype=torch.int64, device=dev)
        self._local = local.unsqueeze(0).repeat(layers, 1)  # [L, per_rank] logical expert of each local slot
        self._due = max(1, interval // 4)

    def after_step(self) -> Replacement | None:
        """Record the step's counts; re-place when due (returns what it did, on every rank)."""
        if not self.enabled:
            return None
        self.steps += 1
        ep = self.model.expert_parallel
        self._ring[self._row].copy_(ep.load)
        ep.load.zero_()
        self._row = (self._row + 1) % self.window
        self._due -= 1
        if self._due > 0:
            return None
        self._due = self.interval
        return self._replace()

    def window_counts(self) -> torch.Tensor:
        """[window, L, E] tokens per logical expert over the whole group (a collective: every rank calls it)."""
        ep, (w, layers, per_rank) = self.model.expert_parallel, self._ring.shape
        counts = torch.zeros(w, layers, ep.placement.num_logical, dtype=torch.int64, device=self._ring.device)
        counts.scatter_add_(2, self._local.expand(w, layers, per_rank), self._ring)
        dist.all_reduce(counts, group=self.group)
        return counts.cpu()

    def _replace(self) -> Replacement:
        start = time.perf_counter()
        model, ep = self.model, self.model.expert_parallel
        counts = self.last_counts = self.window_counts()
        old = list(ep.layer_placements)
        maps = torch.empty(len(old), ep.placement.num_physical, dtype=torch.int64, device=self._ring.device)
        if self.rank == 0:
            maps.copy_(torch.tensor([p.physical_to_logical for p in replan(counts, old).placements]))
        root = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast(maps, src=root, group=self.group)
        new = [ExpertPlacement(tuple(row), ep.placement.num_logical, ep.placement.num_ranks) for row in maps.tolist()]
        moved_bytes = moved = 0
        for lw, a, b in zip(model.layers, old, new):
            move_experts(lw.ffn.experts, plan_moves(a, b, self.rank), self.group)
            n = transfers(a, b)
            moved, moved_bytes = moved + n, moved_bytes + n * slot_bytes(lw.ffn.experts)
        tables = [replica_table(p, self._width) for p in new]
        ep.replicas.copy_(torch.stack([t for t, _ in tables]))
        ep.copies.copy_(torch.stack([c for _, c in tables]))
        self._local.copy_(torch.tensor([p.local_logical(self.rank) for p in new]))
        ep.layer_placements[:] = new
        if self._ring.device.type == "cuda":
            torch.cuda.synchronize(self._ring.device)  # the moves are asynchronous there: time them whole
        rec = Replacement(self.steps, len(new), new[0], min(self.steps, self.window),
                          imbalance_over_layers(counts, old), imbalance_over_layers(counts, new), moved, moved_bytes,
                          time.perf_counter() - start)
        if self.rank == 0:
            log.info(rec.log_line())
        self.last = rec
        return rec


def skewed_imbalance_report(num_experts: int = 384, num_ranks: int = 8, redundant_experts: int = 32,
                            top_k: int = 6, tokens_per_rank: int = 64, steps: int = 100, layers: int = 4,
                            zipf: float = 1.2, seed: int = 0) -> dict:
    """EPLB's imbalance before/after on a skewed synthetic routing, without a model or a process group (CPU or
    GPU host, for benchmarks/parallel_gpu.py). Each step every rank routes `tokens_per_rank` tokens to `top_k`
    distinct experts drawn with Zipf-like popularity (exponent `zipf`, a different hot set per layer); the counts
    go through the runtime's own re-placement (`replan`, from DeepInfer's initial layout). Reported two ways:
    `policy_*` the policy's model (an expert's tokens split evenly over its copies, the number in the log line), and
    `dispatched_*` the rows each rank actually computes under the dispatch's copy choice (`choose_copies`), both as
    Σ max / Σ mean rank load over steps and layers."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf
    idx = []  # per layer: [steps, ranks, tokens, k]
    for _ in range(layers):
        p = base[torch.randperm(num_experts, generator=g)]
        draws = torch.multinomial(p.expand(steps * num_ranks * tokens_per_rank, -1), top_k, generator=g)
        idx.append(draws.view(steps, num_ranks, tokens_per_rank, top_k))
    counts = torch.stack([torch.stack([torch.bincount(i[s].reshape(-1), minlength=num_experts) for s in range(steps)])
                          for i in idx], dim=1)  # [steps, layers, E]
    initial = ExpertPlacement.initial(num_experts, num_ranks, redundant_experts)
    plan = replan(counts, [initial] * layers)

    def dispatched(placements) -> float:
        peak = mean = 0.0
        for i, p in enumerate(placements):
            table = replica_table(p)
            for s in range(steps):
                rows = torch.zeros(num_ranks, dtype=torch.int64)
                for r in range(num_ranks):  # each DP rank picks copies for its own tokens
                    rows += torch.bincount(choose_copies(idx[i][s, r], p, r, table).reshape(-1) // p.per_rank,
                                           minlength=num_ranks)
                peak, mean = peak + rows.max().item(), mean + rows.float().mean().item()
        return peak / mean

    before, after = dispatched([initial] * layers), dispatched(plan.placements)
    line = (f"[EPLB] skewed synthetic routing ({num_experts} experts, top-{top_k}, Zipf {zipf}, {num_ranks} ranks x "
            f"{tokens_per_rank} tokens, {steps} steps, {layers} layers; {initial.num_physical - num_experts} "
            f"redundant slots): imbalance (max/mean rank load) {plan.imbalance_before:.3f} -> "
            f"{plan.imbalance_after:.3f} (policy), {before:.3f} -> {after:.3f} (as dispatched)")
    return {"num_experts": num_experts, "num_ranks": num_ranks, "redundant_slots": initial.num_physical - num_experts,
            "top_k": top_k, "tokens_per_step": num_ranks * tokens_per_rank, "steps": steps, "layers": layers,
            "zipf": zipf, "policy_before": plan.imbalance_before, "policy_after": plan.imbalance_after,
            "dispatched_before": before, "dispatched_after": after, "moved": plan.moved, "log_line": line}
