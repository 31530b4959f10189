"""CacheManager: pure-Python allocation of the cache pools' slots and blocks (the runner holds the tensors).

A sequence holds one *slot* (the part of its state that does not grow: window rings, open compression groups,
Engram history) and a list of *blocks* of `block_size` tokens of context (compressed-KV entries and indexer keys).
The CacheManager hands out real slot and block ids; the scheduler puts them into each step's rows, and the model
runner addresses the pools with them. Bookkeeping is O(blocks) in compact arrays, never one object per block.

With prefix caching (engine/prefix_cache.py) blocks are reference-counted: a request that hits shares the cached
blocks of its prefix, a freed block that holds a named prefix stays cached (LRU) until the pool needs it, and
checkpoint slots (after the sequence slots, in the same pools) hold window checkpoints.
"""

from __future__ import annotations

import math
from array import array

from deepinfer.engine.prefix_cache import NO_HIT, Hit, PrefixIndex


def bytes_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class CacheManager:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int, block_bytes: int = 0, slot_bytes: int = 0,
                 prefix_caching: bool = False, checkpoint_slots: int = 0):
        """checkpoint_slots (prefix caching): slots num_slots .. num_slots + checkpoint_slots - 1 of the pools."""
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
        self.checkpoint_slots = checkpoint_slots if prefix_caching else 0
        self.prefix = PrefixIndex(list(range(num_slots, num_slots + self.checkpoint_slots))) if prefix_caching else None
        self._refs = array("i", bytes(4 * num_blocks)) if prefix_caching else None  # sequences holding each block
        self._named: dict[int, int] = {}  # request -> its leading blocks already offered to the prefix index

    @classmethod
    def from_budget(cls, memory_budget: int, slot_bytes: int, block_bytes: int, block_size: int, max_num_seqs: int,
                    max_model_len: int, prefix_caching: bool = False,
                    checkpoint_fraction: float = 0.0) -> "CacheManager":
        """Slots for max_num_seqs sequences (fewer if the budget is small), with prefix caching checkpoint slots
        for `checkpoint_fraction` of the budget (at least one, at most one per block), the rest of the budget in
        blocks, never more blocks than all slots could fill at max_model_len (a huge budget costs nothing)."""
        if memory_budget <= 0:
            raise ValueError(f"cache.memory_budget must be > 0 bytes, got {memory_budget}")
        per_seq_min = slot_bytes + block_bytes
        if memory_budget < per_seq_min:
            raise ValueError(
                f"cache.memory_budget={memory_budget} B cannot hold one sequence: it needs {slot_bytes} B of fixed "
                f"state plus {block_bytes} B per block of {block_size} tokens")
        checkpoints = 0
        if prefix_caching:
            checkpoints = max(1, int(checkpoint_fraction * memory_budget) // max(slot_bytes, 1))
            checkpoints = min(checkpoints, max(0, (memory_budget - per_seq_min) // max(slot_bytes, 1)))
        budget = memory_budget - checkpoints * slot_bytes
        slots = max(1, min(max_num_seqs, budget // per_seq_min))
        blocks = max(1, min((budget - slots * slot_bytes) // max(block_bytes, 1),
                            slots * math.ceil(max_model_len / block_size)))
        checkpoints = min(checkpoints, blocks)  # a checkpoint is of no use without a cached block before it
        return cls(slots, int(blocks), block_size, block_bytes, slot_bytes, prefix_caching, int(checkpoints))

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
        """Blocks a reservation may take: free ones and cached ones no sequence holds (evicted when taken)."""
        cached = len(self.prefix.evictable) if self.prefix is not None else 0
        return len(self._free) + self.num_blocks - self._fresh + cached

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a named prefix, held by a sequence or not."""
        return len(self.prefix.hash_of) if self.prefix is not None else 0

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
    def extra_blocks(self, request_id: int, num_tokens: int, hit: Hit = NO_HIT) -> int:
        have = len(self._held[request_id]) if request_id in self._held else hit.num_blocks
        return max(0, self.blocks_for(num_tokens) - have)

    def can_hold(self, request_id: int, num_tokens: int, hit: Hit = NO_HIT) -> bool:
        """Whether `request_id` could grow (or be admitted, sharing `hit`'s blocks) to `num_tokens` tokens of
        context now."""
        if request_id not in self._slot and not self._free_slots:
            return False
        taken = 0  # shared blocks that nobody holds leave the free count when the request takes them
        if hit.num_blocks and request_id not in self._slot:
            taken = sum(1 for b in hit.blocks if not self._refs[b])
        return self.extra_blocks(request_id, num_tokens, hit) + taken <= self._num_free_blocks

    def reserve(self, request_id: int, num_tokens: int, hit: Hit = NO_HIT) -> None:
        """Grow (or create, with a slot and `hit`'s shared blocks first) the reservation to cover `num_tokens`;
        never shrinks. Raises if it does not fit."""
        if not self.can_hold(request_id, num_tokens, hit):
            raise MemoryError(f"request {request_id}: {self.extra_blocks(request_id, num_tokens, hit)} blocks needed, "
                              f"{self._num_free_blocks} free, {len(self._free_slots)} free slots")
        if request_id not in self._slot:
            self._slot[request_id] = self._free_slots.pop()
            self._held[request_id] = array("i")
            self._published[request_id] = 0
            for b in hit.blocks:
                if not self._refs[b]:
                    del self.prefix.evictable[b]
                self._refs[b] += 1
                self._held[request_id].append(b)
            self._named[request_id] = hit.num_blocks
        held = self._held[request_id]
        for _ in range(self.extra_blocks(request_id, num_tokens)):
            held.append(self._take_block())
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def _take_block(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._fresh < self.num_blocks:
            b = self._fresh
            self._fresh += 1
        else:
            b = self.prefix.evict_block()
        if self._refs is not None:
            self._refs[b] = 1
        return b

    def take_new_blocks(self, request_id: int) -> tuple[int, ...]:
        """Blocks reserved since the last call: what the next row of the request tells the runner."""
        held = self._held[request_id]
        start, self._published[request_id] = self._published[request_id], len(held)
        return tuple(held[start:])

    def free(self, request_id: int) -> None:
        """Return the slot and every block of `request_id` (finish or preemption). Freeing twice is a no-op. A
        block that holds a named prefix stays cached when no sequence holds it any more; its last blocks are
        the first evicted (appended first to the LRU), its first ones, the most shared, the last."""
        slot = self._slot.pop(request_id, None)
        if slot is None:
            return
        self._free_slots.append(slot)
        held = self._held.pop(request_id)
        self._published.pop(request_id, None)
        self._named.pop(request_id, None)
        held.reverse()
        if self.prefix is None:
            self._free.extend(held)
            return
        for b in held:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self.prefix.hash_of:
                self.prefix.evictable[b] = None
            else:
                self._free.append(b)

    # ---- prefix caching -----------------------------------------------------------------------------------
    def match(self, hashes: list[bytes], max_tokens: int) -> Hit:
        """The cached prefix of a request whose full blocks hash to `hashes`, at most `max_tokens` tokens long
        (a request computes at least one token of its own)."""
        if self.prefix is None:
            return NO_HIT
        return self.prefix.lookup(hashes, max_tokens // self.block_size)

    def count_lookup(self, num_tokens: int, hit: Hit) -> None:
        """An admitted request looked up its `num_tokens` known tokens and starts after `hit`'s."""
        if self.prefix is not None:
            self.prefix.queries += num_tokens
            self.prefix.hits += hit.num_blocks * self.block_size

    def name_blocks(self, request_id: int, hashes: list[bytes], num_tokens: int) -> list[bytes]:
        """Offers the request's blocks that its first `num_tokens` tokens fill (`hashes[i]`: block i's chain
        hash) to the prefix index; returns the hashes newly registered (pending until their step's result)."""
        if self.prefix is None:
            return []
        held, start = self._held[request_id], self._named[request_id]
        end = min(num_tokens // self.block_size, len(hashes), len(held))
        new = [hashes[i] for i in range(start, end) if self.prefix.register_block(held[i], hashes[i])]
        self._named[request_id] = max(start, end)
        return new

    def has_checkpoint(self, h: bytes) -> bool:
        return self.prefix is not None and self.prefix.has_checkpoint(h)

    def take_checkpoint(self, h: bytes) -> int:
        """A checkpoint slot for the boundary whose last block hashes to `h` (-1: none, or it has one)."""
        return self.prefix.take_checkpoint(h) if self.prefix is not None else -1

    def settle(self, blocks: list[bytes], checkpoints: list[bytes], ok: bool) -> None:
        """A step's result is in: what it registered may be matched (ok) or is forgotten (the step failed)."""
        if self.prefix is None or not (blocks or checkpoints):
            return
        if ok:
            self.prefix.confirm(blocks, checkpoints)
        else:
            self._free.extend(self.prefix.forget(blocks, checkpoints))

    def prefix_stats(self) -> dict | None:
        p = self.prefix
        if p is None:
            return None
        return {"queries": p.queries, "hits": p.hits, "evicted_blocks": p.evicted_blocks,
                "checkpoints_taken": p.checkpoints_taken, "evicted_checkpoints": p.evicted_checkpoints,
                "cached_blocks": len(p.hash_of), "checkpoints": p.num_checkpoints,
                "checkpoint_bytes": p.num_checkpoints * self.slot_bytes}

    def describe(self) -> str:
        sizes = ""
        if self.block_bytes:
            total = (self.num_slots + self.checkpoint_slots) * self.slot_bytes + self.num_blocks * self.block_bytes
            sizes = (f" ({bytes_text(self.slot_bytes)}/slot, {bytes_text(self.block_bytes)}/block, "
                     f"{bytes_text(total)} in all)")
        prefix = ""
        if self.prefix is not None:
            prefix = f"; prefix caching on, {self.checkpoint_slots} window checkpoints"
        return (f"cache: {self.num_slots} slots, {self.num_blocks} blocks x {self.block_size} tokens{sizes}; "
                f"capacity {self.capacity_tokens} tokens for one sequence{prefix}")
