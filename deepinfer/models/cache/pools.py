"""The cache pools: every cache of every sequence, allocated once, addressed by slot and block ids.

Per sequence *slot* (a fixed amount, whatever the context length):
  - each layer's sliding-window ring: `ring` rows of window KV (FP8), row of position p = slot * ring + p % ring;
    `ring` = window + max(max_rollback, checkpoint_lag), so a query always finds its window, a rollback finds what
    it undoes, and (prefix caching) a step that ran up to `checkpoint_lag` tokens past a block boundary still holds
    the window at that boundary (the slot copied after the step is the state at the boundary, rolled forward);
  - one shared ring of the positions held (`win_pos`, the decode kernel's visibility test; -1 = empty);
  - per ratio > 1 KV source, the raw fp32 (kv, gate) rows of the still-open compression group (+ rollback);
  - the compressed token ids the Engram hash looks back over (+ rollback);
  - each DSpark draft layer's sliding-window ring (same layout as the backbone's): keys projected from the target
    layers' features of every main-model token, read by the drafter's block attention.
Per *block* of `block_size` tokens of context: per KV source, `block_size / ratio` compressed-KV entries (FP4) and
as many indexer keys (FP4); entry e of a sequence lives at row `blocks[e // per_block] * per_block + e % per_block`.
Every pool has one extra last row, the *trash row*: masked writes go there (so a step writes with static shapes and
no host decision), and nothing ever reads it back. One spare slot and one spare block beyond those handed out serve
the padding rows of a replayed CUDA graph.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cached_property

import torch

from deepinfer.kernels.torch.cache_formats import (Fp4Codec, Fp8Codec, compressed_codec, index_key_codec, row_bytes,
                                                   window_codec)


@dataclass(frozen=True)
class SourceLayout:
    layer: int
    ratio: int
    per_block: int  # entries per block
    open_rows: int  # raw rows kept per slot (ratio > 1): the open group + rollback
    has_index: bool


class CacheLayout:
    """Shapes and formats of every cache, from the model config (no tensors)."""

    def __init__(self, cfg, dtype: torch.dtype, block_size: int, max_rollback: int = 0, draft_layers: int = 0,
                 checkpoint_lag: int = 0):
        self.cfg, self.dtype, self.block_size, self.max_rollback = cfg, dtype, block_size, max_rollback
        self.checkpoint_lag = checkpoint_lag
        self.num_layers = cfg.num_hidden_layers
        self.draft_layers = draft_layers
        self.window = cfg.sliding_window
        # rows kept behind a sequence's newest token, beyond its window: what a rollback undoes, or how far a step
        # may run past a checkpoint boundary (positions addressed mod `ring`: the reads never depend on its width)
        behind = max(max_rollback, checkpoint_lag)
        self.ring = cfg.sliding_window + behind
        if behind and self.window % 64 == 0:  # the decode kernel reads whole 64-row blocks of the ring
            self.ring = -(-self.ring // 64) * 64
        self.head_dim, self.index_dim = cfg.head_dim, cfg.index_head_dim
        self.win_codec = window_codec(cfg.head_dim, dtype)
        self.cmp_codec = compressed_codec(cfg.head_dim, dtype)
        self.key_codec = index_key_codec(cfg.index_head_dim, dtype)
        # the window and compressed KV in the released formats: what the decode attention op reads as stored
        self.as_stored = isinstance(self.win_codec, Fp8Codec) and isinstance(self.cmp_codec, Fp4Codec)
        self.sources: dict[int, SourceLayout] = {}
        for layer in cfg.kv_source_layer_ids:
            r = cfg.compress_ratios[layer]
            if block_size % r:
                raise ValueError(f"cache.block_size={block_size} must be a multiple of every compress ratio ({r})")
            self.sources[layer] = SourceLayout(layer, r, block_size // r, r - 1 + max_rollback if r > 1 else 0,
                                               layer in cfg.index_source_layer_ids)
        # open groups need no lag: a checkpoint boundary is block-aligned, so no group is open there
        self.ngram_rows = cfg.engram_max_ngram_size - 1 + behind if cfg.engram_layer_ids else 0

    @cached_property
    def write_rings(self) -> dict:
        """Rows per slot of every ring a step writes its new tokens into, in a fixed order: "window", each ratio > 1's
        open groups (key: the ratio), "ngram" (Engram's look-back, if any)."""
        rings = {"window": self.ring}
        for src in self.sources.values():
            if src.ratio > 1:
                rings.setdefault(src.ratio, src.open_rows)
        if self.ngram_rows:
            rings["ngram"] = self.ngram_rows
        return rings

    # ---- bytes ------------------------------------------------------------------------------------------------
    def bytes_per_token(self) -> float:
        """Stored bytes that grow with context: compressed KV + indexer keys of each source."""
        per_entry = {s: row_bytes(self.cmp_codec, self.head_dim) + (row_bytes(self.key_codec, self.index_dim)
                                                                     if src.has_index else 0)
                     for s, src in self.sources.items()}
        return sum(per_entry[s] / src.ratio for s, src in self.sources.items())

    def block_bytes(self) -> int:
        return int(round(self.bytes_per_token() * self.block_size))

    def slot_bytes(self) -> int:
        """Fixed bytes per sequence: window rings (+ positions), open groups, Engram history."""
        rings = self.num_layers + self.draft_layers
        win = rings * self.ring * row_bytes(self.win_codec, self.head_dim) + 4 * self.ring
        groups = sum(src.open_rows * 2 * self.head_dim * 4 for src in self.sources.values())
        return win + groups + 8 * self.ngram_rows

    def describe(self) -> str:
        return (f"window {self.win_codec.name} x{self.ring} rows/slot, compressed KV {self.cmp_codec.name}, "
                f"indexer keys {self.key_codec.name}: {self.bytes_per_token():.1f} B/token + "
                f"{self.slot_bytes()} B/sequence")


class CachePools:
    """The tensors of a CacheLayout for `num_slots` sequences and `num_blocks` blocks, allocated once."""

    def __init__(self, layout: CacheLayout, num_slots: int, num_blocks: int, device):
        self.layout, self.num_slots, self.num_blocks = layout, num_slots, num_blocks
        self.spare_slot, self.spare_block = num_slots, num_blocks
        self.slots_alloc, self.blocks_alloc = num_slots + 1, num_blocks + 1
        self.device = torch.device(device)
        L = layout
        num_slots, num_blocks = self.slots_alloc, self.blocks_alloc

        def alloc(rows: int, codec, width: int):
            return tuple(torch.zeros(rows + 1, *shape, dtype=dt, device=self.device) for shape, dt in codec.parts(width))

        self.window = [alloc(num_slots * L.ring, L.win_codec, L.head_dim) for _ in range(L.num_layers)]
        self.draft_window = [alloc(num_slots * L.ring, L.win_codec, L.head_dim) for _ in range(L.draft_layers)]
        self.win_pos = torch.full((num_slots * L.ring + 1,), -1, dtype=torch.int32, device=self.device)
        self.compressed, self.index_keys, self.open_groups = {}, {}, {}
        for s, src in L.sources.items():
            entries = num_blocks * src.per_block
            self.compressed[s] = alloc(entries, L.cmp_codec, L.head_dim)
            if src.has_index:
                self.index_keys[s] = alloc(entries, L.key_codec, L.index_dim)
            if src.open_rows:
                self.open_groups[s] = torch.zeros(num_slots * src.open_rows + 1, 2, L.head_dim,
                                                  dtype=torch.float32, device=self.device)
        self.ngram = torch.zeros(num_slots * max(L.ngram_rows, 1) + 1, dtype=torch.int64, device=self.device)
        # rows per slot of each ring a step writes (layout.write_rings) and its trash row, as [rings, 1] columns: a
        # step derives every ring's write rows in one pass (models/cache/metadata.py)
        rings = torch.tensor(list(L.write_rings.values()), dtype=torch.int64)[:, None]
        self.write_ring_rows, self.write_ring_trash = rings.to(self.device), (num_slots * rings).to(self.device)
        # a one-row compressed pool for layers that have none (the decode kernel takes one anyway)
        self.no_compressed = alloc(0, L.cmp_codec, L.head_dim)

    def slot_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every per-slot tensor with its rows per slot: window rings (+ DSpark's), the positions they hold, open
        compression groups, Engram history."""
        L = self.layout
        out = [(t, L.ring) for parts in self.window + self.draft_window for t in parts] + [(self.win_pos, L.ring)]
        out += [(t, self.layout.sources[s].open_rows) for s, t in self.open_groups.items()]
        return out + [(self.ngram, max(L.ngram_rows, 1))]

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot dst's fixed state becomes slot src's (a prefix-cache window checkpoint, taken or restored): rows
        are addressed by position within a slot, so the copy holds the same positions. Device-side copies only."""
        for t, rows in self.slot_tensors():
            t[dst * rows:(dst + 1) * rows].copy_(t[src * rows:(src + 1) * rows])

    def nbytes(self) -> int:
        tensors = [t for parts in self.window + self.draft_window for t in parts] + [self.win_pos, self.ngram]
        tensors += [t for d in (self.compressed, self.index_keys) for parts in d.values() for t in parts]
        tensors += list(self.open_groups.values())
        return sum(t.numel() * t.element_size() for t in tensors)


class SequenceCache:
    """One sequence's place in the pools: its slot, its blocks (in order) and how many tokens it holds."""

    def __init__(self, pools: CachePools, slot: int, blocks=(), allocator=None):
        self.pools, self.slot = pools, slot
        self.blocks: list[int] = list(blocks)
        self.num_tokens = 0
        self._allocator = allocator  # standalone use (no engine): where free() returns slot and blocks
        self._finalizer = weakref.finalize(self, allocator.release_ids, slot, self.blocks) if allocator else None

    @property
    def max_rollback(self) -> int:
        return self.pools.layout.max_rollback

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pools.layout.block_size

    def reserve(self, num_tokens: int) -> None:
        """Blocks for `num_tokens` of context: a standalone sequence takes them now; an engine's sequence already
        holds what the CacheManager reserved (a shortfall is an error when the step is packed)."""
        if self._allocator is not None:
            self._allocator.grow(self, num_tokens)

    def rollback(self, n: int) -> None:
        """Forget the last n tokens (n <= max_rollback). Every cache is addressed by position, so moving the
        token count back is the whole undo: later writes overwrite what the forgotten tokens left behind."""
        if n > self.max_rollback or n > self.num_tokens:
            raise ValueError(f"rollback({n}) exceeds max_rollback={self.max_rollback} or num_tokens={self.num_tokens}")
        self.num_tokens -= n

    def nbytes(self) -> int:
        if self.slot < 0:
            return 0
        L = self.pools.layout
        return L.slot_bytes() + len(self.blocks) * L.block_bytes()

    def free(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # returns slot and blocks to the standalone allocator, once
        self._allocator = self._finalizer = None
        self.blocks, self.slot = [], -1


class StandaloneAllocator:
    """Hands out slots and blocks of one CachePools when no engine does (tests, scripts): blocks on demand."""

    def __init__(self, pools: CachePools):
        self.pools = pools
        self._slots = list(range(pools.num_slots - 1, -1, -1))
        self._blocks = list(range(pools.num_blocks - 1, -1, -1))

    def new(self) -> SequenceCache:
        if not self._slots:
            raise MemoryError(f"all {self.pools.num_slots} cache slots are in use")
        return SequenceCache(self.pools, self._slots.pop(), allocator=self)

    def grow(self, seq: SequenceCache, num_tokens: int) -> None:
        need = -(-num_tokens // self.pools.layout.block_size) - len(seq.blocks)
        if need > len(self._blocks):
            raise MemoryError(f"the cache pools have {len(self._blocks)} free blocks, {need} needed")
        seq.blocks.extend(self._blocks.pop() for _ in range(max(need, 0)))  # in place: the finalizer holds the list

    def release_ids(self, slot: int, blocks: list[int]) -> None:
        self._slots.append(slot)
        self._blocks.extend(reversed(blocks))
