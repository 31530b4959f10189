"""EPLB placement policy (the pure part of issue 13 item 4): from measured per-expert token counts, choose which
logical experts get the redundant physical slots and which rank holds each physical expert, so the busiest rank's
load comes close to the mean. Moving the weights and counting tokens in the engine are not here.

Follows DeepInfer 0.1.0 `deepinfer/model_executor/eplb/policy.py` (`rebalance_experts_global`), one MoE layer
at a time:
  1. replication: one redundant slot per round, given to the logical expert whose extra copy minimises
     Σ_steps max_expert(load per copy), a copy's load being its expert's count / its number of copies (tokens
     spread evenly over the copies). With one step this is "copy the expert with the highest load per copy".
  2. assignment (`_batch_greedy_indices`): physical experts in descending load per copy (stable: routed experts
     first in id order, then the copies in the order they were made), each placed on the rank, among those
     with a free slot, that minimises Σ_steps max(peak_step, rank_load_step + its load_step), where peak is the
     highest rank load so far in that step.
Where this differs: DeepInfer breaks a tie of that score by the lowest rank id; here by the lower current rank
load, then the lowest rank id (with one step, every rank that stays under the peak ties, and the lowest-id rule
would fill rank 0 first). DeepInfer separates equal loads in step 1 by adding id·1e-4 to the counts; here ties
go to the higher total load, then the lower id. The imbalance reported is DeepInfer's log metric inverted:
Σ_steps max_rank load / Σ_steps mean_rank load (1.0 = perfectly balanced), DeepInfer's `rank_balance` being
mean / mean peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import ExpertPlacement


@dataclass(frozen=True)
class Rebalance:
    placement: ExpertPlacement
    copies: tuple[int, ...]  # per logical expert
    imbalance_before: float  # of `current` (or the initial layout) on the same counts
    imbalance_after: float

    def log_line(self) -> str:
        hot = max(range(len(self.copies)), key=lambda e: (self.copies[e], -e))
        return (f"[EPLB] {self.placement.num_physical} physical experts on {self.placement.num_ranks} ranks "
                f"({self.placement.per_rank} each): imbalance (max/mean rank load) {self.imbalance_before:.3f} -> "
                f"{self.imbalance_after:.3f}; most copies: expert {hot} x{self.copies[hot]}")


def rebalance(counts: torch.Tensor, num_ranks: int, num_redundant: int,
              current: ExpertPlacement | None = None) -> Rebalance:
    """counts: [E] or [window steps, E] tokens per logical expert. Returns the new placement (num_ranks ranks,
    E + num_redundant physical experts, which must divide evenly) with the imbalance before and after."""
    load = _as_window(counts)
    num_logical = load.shape[1]
    if num_ranks < 1 or num_redundant < 0 or (num_logical + num_redundant) % num_ranks:
        raise ValueError(f"{num_logical} experts + {num_redundant} redundant do not divide over {num_ranks} ranks")
    if current is None:
        current = ExpertPlacement.initial(num_logical, num_ranks, num_redundant)
    if current.num_logical != num_logical:
        raise ValueError(f"current placement has {current.num_logical} logical experts; counts have {num_logical}")
    copies, made = _replicate(load, num_redundant)
    per_rank = _assign(load, copies, list(range(num_logical)) + made, num_ranks)
    placement = ExpertPlacement.from_ranks(per_rank, num_logical)
    return Rebalance(placement, tuple(copies.tolist()), imbalance(load, current), imbalance(load, placement))


def imbalance(counts: torch.Tensor, placement: ExpertPlacement) -> float:
    """Σ_steps max rank load / Σ_steps mean rank load, with each expert's count split evenly over its copies."""
    load = _as_window(counts)
    rank_load = rank_loads(load, placement)  # [W, R]
    mean = rank_load.mean(dim=1).sum().item()
    return rank_load.max(dim=1).values.sum().item() / mean if mean > 0 else 1.0


def rank_loads(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """[W, E] float64 load per logical expert -> [W, R] load per rank, each expert's load split evenly over its
    copies (the policy's model of the dispatch)."""
    copies = torch.bincount(torch.tensor(placement.physical_to_logical), minlength=placement.num_logical)
    per_copy = load / copies  # [W, E]
    phys = per_copy[:, list(placement.physical_to_logical)]  # [W, P]
    return phys.view(load.shape[0], placement.num_ranks, placement.per_rank).sum(dim=2)


def _replicate(load: torch.Tensor, num_redundant: int) -> tuple[torch.Tensor, list[int]]:
    """Copies per logical expert after handing out the redundant slots, and the expert each slot went to."""
    steps, num_logical = load.shape
    copies = torch.ones(num_logical, dtype=torch.float64)
    total = load.sum(dim=0)
    made = []
    for _ in range(num_redundant):
        per_copy = load / copies  # [W, E]
        top2 = per_copy.topk(min(2, num_logical), dim=1)
        top1, arg1 = top2.values[:, 0], top2.indices[:, 0]
        second = top2.values[:, 1] if num_logical > 1 else torch.zeros(steps, dtype=load.dtype)
        # the step's peak if expert j gets one more copy: unchanged unless j is that step's argmax
        reduced = load / (copies + 1)  # [W, E]
        peak = top1[:, None].expand(-1, num_logical).clone()
        is_top = torch.nn.functional.one_hot(arg1, num_logical).bool()
        peak[is_top] = torch.maximum(second[:, None].expand(-1, num_logical), reduced)[is_top]
        score = peak.sum(dim=0)
        best = min(range(num_logical), key=lambda e: (score[e].item(), -total[e].item(), e))
        copies[best] += 1
        made.append(best)
    return copies.to(torch.int64), made


def _assign(load: torch.Tensor, copies: torch.Tensor, physical: list[int], num_ranks: int) -> list[list[int]]:
    """Greedy: heaviest physical expert first, each to the free rank minimising Σ_steps max(peak, rank load)."""
    per_copy = load / copies.to(load.dtype)  # [W, E]
    capacity = len(physical) // num_ranks
    total = per_copy.sum(dim=0)
    order = sorted(range(len(physical)), key=lambda p: -total[physical[p]].item())  # stable on the slot order
    steps = load.shape[0]
    rank_load = torch.zeros(num_ranks, steps, dtype=load.dtype)
    peak = torch.zeros(steps, dtype=load.dtype)
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for p in order:
        v = per_copy[:, physical[p]]
        score = torch.maximum(rank_load + v, peak).sum(dim=1)
        free = [r for r in range(num_ranks) if len(out[r]) < capacity]
        r = min(free, key=lambda r: (score[r].item(), rank_load[r].sum().item(), r))
        out[r].append(physical[p])
        rank_load[r] += v
        peak = torch.maximum(peak, rank_load[r])
    return out


def _as_window(counts: torch.Tensor) -> torch.Tensor:
    load = torch.as_tensor(counts).to(torch.float64)
    if load.dim() == 1:
        load = load.unsqueeze(0)
    if load.dim() != 2 or load.shape[1] < 1:
        raise ValueError(f"counts must be [E] or [window, E]; got shape {tuple(load.shape)}")
    if (load < 0).any() or not torch.isfinite(load).all():
        raise ValueError("counts must be finite and non-negative")
    return load
