"""Prefix caching's index: which blocks and window checkpoints hold the state of which token prefix. Pure Python.

A V4.1 sequence's state at a block boundary b is (MODEL_V41_SPEC.md §5):
  - its compressed-KV and indexer-key entries of every group before b: whole blocks, a pure function of the
    tokens before b, so a block is named by a hash chained over every token id up to its end (and a root key that
    names everything else the state depends on: the cache salt, later image content);
  - its slot's fixed state at b: the window rings (the last `ring` positions), the open compression groups (empty
    at a block boundary: block_size is a multiple of every ratio) and the Engram n-gram history. These are
    overwritten as the sequence grows, so they are kept as *checkpoints*: copies of a whole slot, in checkpoint
    slots of the same pools, named by the hash of the block that ends at b.
A request hits at the largest boundary b whose blocks are all cached and which has a checkpoint: it shares those
blocks (reference counts; never written again: every later write lands at positions >= b) and its slot is
restored from the checkpoint, so its prefill starts at b.

Blocks and checkpoints registered by a step are *pending* until the step's result is folded in: a failed step
forgets them (the data was never written), and nothing is matched before it is known to be there. Blocks no
sequence holds stay cached in an LRU (least recently used first) until the pool needs them; checkpoints likewise
within their own budget of slots.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


_ROOT = b"deepinfer-prefix-v1"
MAX_CACHE_SALT_CHARS = 1024  # a tenant id or a random token fits; a bound keeps one request's hashing cheap


def cache_salt_error(salt) -> str | None:
    """Why `salt` is not a request's cache_salt (vLLM's field: a non-empty string), or None. None is no salt."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        shown = repr(salt)[:40] + ("..." if len(repr(salt)) > 40 else "")
        return (f"cache_salt={shown} is invalid; allowed: null or a string of 1 to {MAX_CACHE_SALT_CHARS} "
                "characters")
    return None


def root_key(salt: str | None = None, extra: bytes = b"") -> bytes:
    """The hash every chain starts from: requests with different salts (tenants) never share a block; requests
    without one share with each other (the salted root hashes a prefix no unsalted root can produce)."""
    h = hashlib.blake2b(_ROOT, digest_size=16)
    if salt is not None:
        data = salt.encode("utf-8", "surrogatepass")
        h.update(b"salt:%d:" % len(data) + data)
    h.update(extra)
    return h.digest()


def image_root(root: bytes, images) -> bytes:
    """The chain root of a prompt with images (engine/images.py PromptImage): every image span holds the same
    placeholder ids, so the root carries each span's place and its pixels; equal images in equal places share
    blocks, any other image never matches (the blocks before the first image are salted too)."""
    h = hashlib.blake2b(root, digest_size=16)
    for im in images:  # the resized pixels and their canvas fix the patches (processor.ResizedImage)
        r = im.image
        h.update(array("q", [im.start, im.length, r.layout.best_width, r.layout.best_height, r.width,
                             r.height]).tobytes())
        h.update(r.pixels)
    return h.digest()


def extend_hashes(hashes: list[bytes], root: bytes, ids, block_size: int) -> None:
    """Appends the chain hash of every full block of `ids` that `hashes` does not name yet."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(ids) // block_size):
        block = array("q", ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)


@dataclass(frozen=True)
class Hit:
    """The cached prefix a request starts from: its shared blocks and the checkpoint slot of boundary
    len(blocks) * block_size (no checkpoint: no hit); `matched`: how many leading blocks of its tokens are cached,
    checkpoint or not (where it branches off a cached prefix: worth a checkpoint of its own)."""

    blocks: tuple[int, ...] = ()
    checkpoint: int = -1
    matched: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


NO_HIT = Hit()


class PrefixIndex:
    def __init__(self, checkpoint_slots: list[int]):
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks that no sequence holds, LRU first
        self.checkpoint_of: dict[bytes, int] = {}
        self.checkpoint_hash: dict[int, bytes] = {}
        self.checkpoint_lru: OrderedDict[int, None] = OrderedDict()
        self.free_checkpoints = list(reversed(checkpoint_slots))
        self.num_checkpoint_slots = len(checkpoint_slots)
        self.pending_blocks: set[bytes] = set()
        self.pending_checkpoints: set[bytes] = set()
        # counters (run summary): prompt tokens looked up and found, what eviction took, checkpoints written
        self.queries = self.hits = self.evicted_blocks = self.evicted_checkpoints = self.checkpoints_taken = 0

    # ---- lookup -----------------------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], max_blocks: int) -> Hit:
        """The longest usable prefix among the first `max_blocks` block hashes (LRU order refreshed on a hit)."""
        blocks: list[int] = []
        best, slot = 0, -1
        for h in hashes[:max_blocks]:
            b = self.block_of.get(h)
            if b is None or h in self.pending_blocks:
                break
            blocks.append(b)
            c = self.checkpoint_of.get(h)
            if c is not None and h not in self.pending_checkpoints:
                best, slot = len(blocks), c
        if not best:
            return Hit(matched=len(blocks)) if blocks else NO_HIT
        self.checkpoint_lru.move_to_end(slot)
        return Hit(tuple(blocks[:best]), slot, len(blocks))

    # ---- blocks -----------------------------------------------------------------------------------------------
    def register_block(self, block: int, h: bytes) -> bool:
        """Names a block just filled by a planned step (pending until `confirm`); False when the hash or the block
        is named already (another sequence computed the same prefix: this copy stays private)."""
        if h in self.block_of or block in self.hash_of:
            return False
        self.block_of[h], self.hash_of[block] = block, h
        self.pending_blocks.add(h)
        return True

    def evict_block(self) -> int:
        """The least recently used cached block, forgotten (the pool needs it); its checkpoint goes with it."""
        block, _ = self.evictable.popitem(last=False)
        h = self.hash_of.pop(block)
        del self.block_of[h]
        self.pending_blocks.discard(h)
        self.evicted_blocks += 1
        self._drop_checkpoint(h)
        return block

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def has_checkpoint(self, h: bytes) -> bool:
        return h in self.checkpoint_of

    def take_checkpoint(self, h: bytes) -> int:
        """A checkpoint slot for boundary hash `h` (pending until `confirm`): a free one, else the least recently
        used checkpoint's; -1 when there is no checkpoint slot at all or `h` has one."""
        if h in self.checkpoint_of or not self.num_checkpoint_slots:
            return -1
        if self.free_checkpoints:
            slot = self.free_checkpoints.pop()
        else:
            slot, _ = self.checkpoint_lru.popitem(last=False)
            del self.checkpoint_of[self.checkpoint_hash.pop(slot)]
            self.evicted_checkpoints += 1
        self.checkpoint_of[h], self.checkpoint_hash[slot] = slot, h
        self.checkpoint_lru[slot] = None
        self.pending_checkpoints.add(h)
        self.checkpoints_taken += 1
        return slot

    def _drop_checkpoint(self, h: bytes) -> None:
        slot = self.checkpoint_of.pop(h, None)
        if slot is None:
            return
        self.pending_checkpoints.discard(h)
        del self.checkpoint_hash[slot]
        del self.checkpoint_lru[slot]
        self.free_checkpoints.append(slot)

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpoint_of)

    # ---- a step's result --------------------------------------------------------------------------------------
    def confirm(self, blocks: list[bytes], checkpoints: list[bytes]) -> None:
        """The step that wrote these ran: they may be matched from now on."""
        self.pending_blocks.difference_update(blocks)
        self.pending_checkpoints.difference_update(checkpoints)

    def forget(self, blocks: list[bytes], checkpoints: list[bytes]) -> list[int]:
        """The step that was to write these failed: unname them. Returns the forgotten blocks that no sequence
        holds (back to the free list)."""
        freed = []
        for h in blocks:
            if h in self.pending_blocks:
                b = self.block_of.pop(h)
                del self.hash_of[b]
                self.pending_blocks.discard(h)
                if b in self.evictable:
                    del self.evictable[b]
                    freed.append(b)
        for h in checkpoints:
            if h in self.pending_checkpoints:
                self._drop_checkpoint(h)
        return freed
