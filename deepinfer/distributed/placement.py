"""Where each routed expert lives under expert parallelism: `num_physical = num_logical + redundant` expert slots,
`num_physical / num_ranks` per rank, rank r owning physical slots [r * per_rank, (r + 1) * per_rank). A physical
slot holds a copy of one logical expert; a logical expert has one or more copies (replicas).

Follows DeepInfer 0.1.0 (deepinfer/model_executor/eplb/__init__.py): the redundant count is rounded up so the
physical slots divide evenly over the ranks (`resolve_num_extra_experts`), and the initial layout is the routed
experts in order followed by the redundant copies of experts 0, 1, ... (`get_initial_global_physical_to_logical_map`).
"""

from __future__ import annotations

from dataclasses import dataclass


def resolve_num_extra_experts(num_routed: int, min_extra: int, num_ranks: int) -> int:
    """The fewest redundant experts >= `min_extra` that make routed + redundant divisible by `num_ranks`."""
    if num_routed < 1 or min_extra < 0 or num_ranks < 1:
        raise ValueError(f"num_routed={num_routed}, min_extra={min_extra}, num_ranks={num_ranks}: "
                         "allowed: num_routed >= 1, min_extra >= 0, num_ranks >= 1")
    return min_extra + (-(num_routed + min_extra) % num_ranks)


@dataclass(frozen=True)
class ExpertPlacement:
    physical_to_logical: tuple[int, ...]  # physical slot -> logical expert id
    num_logical: int
    num_ranks: int

    def __post_init__(self):
        n = len(self.physical_to_logical)
        if self.num_ranks < 1 or n % self.num_ranks:
            raise ValueError(f"{n} physical experts do not divide over {self.num_ranks} ranks")
        missing = set(range(self.num_logical)) - set(self.physical_to_logical)
        if missing:
            raise ValueError(f"logical experts {sorted(missing)[:8]} have no physical slot")
        if any(not 0 <= e < self.num_logical for e in self.physical_to_logical):
            raise ValueError(f"physical_to_logical holds ids outside 0..{self.num_logical - 1}")

    @classmethod
    def initial(cls, num_logical: int, num_ranks: int, min_extra: int = 0) -> "ExpertPlacement":
        extra = resolve_num_extra_experts(num_logical, min_extra, num_ranks)
        return cls(tuple(range(num_logical)) + tuple(i % num_logical for i in range(extra)), num_logical, num_ranks)

    @classmethod
    def from_ranks(cls, per_rank: list[list[int]], num_logical: int) -> "ExpertPlacement":
        """From each rank's list of logical experts (equal lengths)."""
        if len({len(r) for r in per_rank}) != 1:
            raise ValueError("every rank must hold the same number of physical experts")
        return cls(tuple(e for r in per_rank for e in r), num_logical, len(per_rank))

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def local_logical(self, rank: int) -> tuple[int, ...]:
        """The logical expert of each of `rank`'s slots, in slot order: the weights that rank loads."""
        return self.physical_to_logical[rank * self.per_rank:(rank + 1) * self.per_rank]

    def replicas(self) -> list[list[int]]:
        """logical expert -> its physical slots, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.physical_to_logical):
            out[e].append(p)
        return out

    def per_rank_lists(self) -> list[list[int]]:
        return [list(self.local_logical(r)) for r in range(self.num_ranks)]
