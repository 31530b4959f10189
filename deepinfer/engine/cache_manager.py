"""CacheManager: pure-Python allocation of the cache pools' slots and blocks (the runner holds the tensors).

A sequence holds one *slot* (the part of its state that does not grow: window rings, open compression groups,
Engram history) and a list of *blocks* of `block_size` tokens of context (compressed-KV entries and indexer keys).
The CacheManager hands out real slot and block ids; the scheduler puts them into each step's rows, and the model
runner addresses the pools with them. Bookkeeping is O(blocks) in compact arrays, never one object per block.
"""

from __future__ import annotations

import math
from array import array


def bytes_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class CacheManager:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int, block_bytes: int = 0, slot_bytes: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_slots < 1 or num_blocks < 1:
            raise ValueError(f"the cache needs at least one slot and one block, got {num_slots} and {num_blocks}")
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.block_bytes, self.slot_bytes = block_bytes, slot_bytes  # for describe() only
        # LIFO free lists: recently freed blocks are reused first (warm memory); blocks never handed out are not
        # listed but counted (ids _fresh..num_blocks-1, handed out in ascending order), so a huge cache costs
        # nothing at start
        self._free_slots = array("i", range(num_slots - 1, -1, -1))
        self._free = array("i")
        self._fresh = 0
        self._held: dict[int, array] = {}
        self._slot: dict[int, int] = {}
        self._published: dict[int, int] = {}  # blocks of a request already handed to the runner
        self.peak_used_blocks = 0

    @classmethod
    def from_budget(cls, memory_budget: int, slot_bytes: int, block_bytes: int, block_size: int, max_num_seqs: int,
                    max_model_len: int) -> "CacheManager":
        """Slots for max_num_seqs sequences (fewer if the budget is small), the rest of the budget in blocks, never
        more blocks than all slots could fill at max_model_len."""
        if memory_budget <= 0:
            raise ValueError(f"cache.memory_budget must be > 0 bytes, got {memory_budget}")
        per_seq_min = slot_bytes + block_bytes
        if memory_budget < per_seq_min:
            raise ValueError(
                f"cache.memory_budget={memory_budget} B cannot hold one sequence: it needs {slot_bytes} B of fixed "
                f"state plus {block_bytes} B per block of {block_size} tokens")
        slots = max(1, min(max_num_seqs, memory_budget // per_seq_min))
        useful = slots * math.ceil(max_model_len / block_size)
        blocks = max(1, min((memory_budget - slots * slot_bytes) // max(block_bytes, 1), useful))
        return cls(slots, int(blocks), block_size, block_bytes, slot_bytes)

    # ---- sizing -------------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def capacity_tokens(self) -> int:
        """Longest context one sequence could hold if it had the whole cache."""
        return self.num_blocks * self.block_size

    def fits_alone(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def _num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free_blocks

    @property
    def utilization(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def holds(self, request_id: int) -> bool:
        return request_id in self._slot

    def slot_of(self, request_id: int) -> int:
        return self._slot[request_id]

    def blocks_of(self, request_id: int) -> list[int]:
        return list(self._held.get(request_id, ()))

    # ---- allocation ---------------------------------------------------------------------------------------
    def extra_blocks(self, request_id: int, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._held.get(request_id, ())))

    def can_hold(self, request_id: int, num_tokens: int) -> bool:
        """Whether `request_id` could grow (or be admitted) to `num_tokens` tokens of context now."""
        if request_id not in self._slot and not self._free_slots:
            return False
        return self.extra_blocks(request_id, num_tokens) <= self._num_free_blocks

    def reserve(self, request_id: int, num_tokens: int) -> None:
        """Grow (or create, with a slot) the reservation to cover `num_tokens`; never shrinks. Raises if it does
        not fit."""
        if not self.can_hold(request_id, num_tokens):
            raise MemoryError(f"request {request_id}: {self.extra_blocks(request_id, num_tokens)} blocks needed, "
                              f"{self._num_free_blocks} free, {len(self._free_slots)} free slots")
        if request_id not in self._slot:
            self._slot[request_id] = self._free_slots.pop()
            self._held[request_id] = array("i")
            self._published[request_id] = 0
        held = self._held[request_id]
        for _ in range(self.extra_blocks(request_id, num_tokens)):
            if self._free:
                held.append(self._free.pop())
            else:
                held.append(self._fresh)
                self._fresh += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def take_new_blocks(self, request_id: int) -> tuple[int, ...]:
        """Blocks reserved since the last call: what the next row of the request tells the runner."""
        held = self._held[request_id]
        start, self._published[request_id] = self._published[request_id], len(held)
        return tuple(held[start:])

    def free(self, request_id: int) -> None:
        """Return the slot and every block of `request_id` (finish or preemption). Freeing twice is a no-op."""
        slot = self._slot.pop(request_id, None)
        if slot is None:
            return
        self._free_slots.append(slot)
        held = self._held.pop(request_id)
        self._published.pop(request_id, None)
        held.reverse()
        self._free.extend(held)

    def describe(self) -> str:
        sizes = ""
        if self.block_bytes:
            total = self.num_slots * self.slot_bytes + self.num_blocks * self.block_bytes
            sizes = (f" ({bytes_text(self.slot_bytes)}/slot, {bytes_text(self.block_bytes)}/block, "
                     f"{bytes_text(total)} in all)")
        return (f"cache: {self.num_slots} slots, {self.num_blocks} blocks x {self.block_size} tokens{sizes}; "
                f"capacity {self.capacity_tokens} tokens for one sequence")
