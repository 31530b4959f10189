"""CacheManager: pure-Python accounting of every request's model state in a fixed memory budget.

A sequence's state has a part that does not grow (sliding-window rings, compressor partial groups, Engram
history) and a part that grows with its context (compressed-KV and indexer-key entries). The budget is cut into
blocks of `block_size` tokens of the growing part; the fixed part is charged as a whole number of the same blocks,
so one free list serves both and "does it fit" is a single integer comparison. The model's tensors live in the
ModelRunner; this room only decides who may hold how much.
"""

from __future__ import annotations

import math


class CacheManager:
    def __init__(self, memory_budget: int, bytes_per_token: float, fixed_bytes: int, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget}")
        self.block_size = block_size
        # At least one byte per block even for a model whose growing state is tiny, so capacity stays finite.
        self.block_bytes = max(1, math.ceil(bytes_per_token * block_size))
        self.fixed_blocks = math.ceil(fixed_bytes / self.block_bytes)
        self.num_blocks = memory_budget // self.block_bytes
        if self.num_blocks < self.fixed_blocks + 1:
            raise ValueError(
                f"memory budget {memory_budget} B cannot hold one sequence: it needs {fixed_bytes} B of fixed state "
                f"plus {self.block_bytes} B per block of {block_size} tokens"
            )
        # LIFO free list: recently freed blocks are reused first (warm memory on a real paged pool).
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._held: dict[int, list[int]] = {}
        self._tokens: dict[int, int] = {}
        self.peak_used_blocks = 0

    # ---- sizing -------------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence holding `num_tokens` tokens of context needs, fixed part included."""
        return self.fixed_blocks + math.ceil(num_tokens / self.block_size)

    @property
    def capacity_tokens(self) -> int:
        """Longest context one sequence could hold if it had the whole cache."""
        return (self.num_blocks - self.fixed_blocks) * self.block_size

    def fits_alone(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def utilization(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def holds(self, request_id: int) -> bool:
        return request_id in self._held

    def blocks_of(self, request_id: int) -> list[int]:
        return list(self._held.get(request_id, ()))

    def reserved_tokens(self, request_id: int) -> int:
        """Context tokens the blocks held by this request cover."""
        held = len(self._held.get(request_id, ()))
        return max(0, held - self.fixed_blocks) * self.block_size

    # ---- allocation ---------------------------------------------------------------------------------------
    def extra_blocks(self, request_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._held.get(request_id, ())))

    def can_hold(self, request_id: int, num_tokens: int) -> bool:
        """Whether `request_id` could grow (or be admitted) to `num_tokens` tokens of context now."""
        return self.extra_blocks(request_id, num_tokens) <= len(self._free)

    def reserve(self, request_id: int, num_tokens: int) -> None:
        """Grow (or create) the reservation to cover `num_tokens`; never shrinks. Raises if it does not fit."""
        need = self.extra_blocks(request_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"request {request_id}: {need} blocks needed, {len(self._free)} free")
        held = self._held.setdefault(request_id, [])
        for _ in range(need):
            held.append(self._free.pop())
        self._tokens[request_id] = max(num_tokens, self._tokens.get(request_id, 0))
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def free(self, request_id: int) -> None:
        """Return every block of `request_id` (finish or preemption). Freeing twice is a no-op."""
        held = self._held.pop(request_id, None)
        self._tokens.pop(request_id, None)
        if held:
            self._free.extend(reversed(held))

    def describe(self) -> str:
        return (
            f"cache: {self.num_blocks} blocks x {self.block_size} tokens ({self.block_bytes} B/block), "
            f"{self.fixed_blocks} blocks fixed state per sequence; capacity {self.capacity_tokens} tokens for one "
            f"sequence, at most {self.num_blocks // (self.fixed_blocks + 1)} sequences at once"
        )
