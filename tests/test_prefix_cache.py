"""The prefix cache's bookkeeping (pure Python): chained block hashes, shared reference-counted blocks, an LRU of
cached blocks evicted only when the pool needs them, window checkpoints, and entries that are matched only once
the step that writes them has run."""

from __future__ import annotations

import random

from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.prefix_cache import extend_hashes, root_key

BS = 4


def hashes(ids, salt=None):
    out: list[bytes] = []
    extend_hashes(out, root_key(salt), ids, BS)
    return out


def cache(blocks=8, slots=4, checkpoints=2) -> CacheManager:
    return CacheManager(slots, blocks, BS, prefix_caching=True, checkpoint_slots=checkpoints)


def compute(c: CacheManager, rid: int, ids: list[int], checkpoint_at: int | None = None, ok: bool = True):
    """What the scheduler does for a request that prefills `ids` in one step: reserve, name its full blocks,
    checkpoint a boundary, then fold the step's result in."""
    h = hashes(ids)
    hit = c.match(h, len(ids) - 1)
    c.reserve(rid, len(ids), hit)
    named = c.name_blocks(rid, h, len(ids))
    ckpts = []
    if checkpoint_at:
        slot = c.take_checkpoint(h[checkpoint_at // BS - 1])
        if slot >= 0:
            ckpts.append(h[checkpoint_at // BS - 1])
    c.settle(named, ckpts, ok)
    return hit


def test_a_block_hash_names_every_token_before_the_block_end_and_the_salt():
    a, b = list(range(12)), list(range(12))
    b[1] = 99
    assert hashes(a)[:3] == hashes(list(range(12)))
    assert all(x != y for x, y in zip(hashes(a), hashes(b)))  # a change in block 0 renames every later block
    assert hashes(a, salt="tenant-1")[0] != hashes(a)[0] != hashes(a, salt="tenant-2")[0]
    assert len(hashes(list(range(11)))) == 2  # only full blocks are named


def test_a_hit_needs_the_blocks_and_a_checkpoint_at_their_end():
    c = cache()
    ids = list(range(10))
    compute(c, 1, ids)  # blocks named, no checkpoint
    assert c.match(hashes(ids), 9).num_blocks == 0
    assert c.match(hashes(ids), 9).matched == 2  # the branch point a later request would checkpoint
    compute(c, 2, ids, checkpoint_at=8)
    hit = c.match(hashes(ids + [50, 51]), 11)
    assert hit.num_blocks == 2 and hit.checkpoint == 4  # checkpoint slots follow the 4 sequence slots
    assert c.match(hashes(ids), 7).num_blocks == 0  # at most 7 tokens: the boundary at 8 is out of reach
    assert c.match(hashes([0, 1, 2, 9] + ids[4:]), 9).num_blocks == 0  # another first block: nothing shared


def test_shared_blocks_are_counted_once_and_freed_blocks_stay_cached_until_the_pool_needs_them():
    c = cache(blocks=6)
    ids = list(range(8))
    compute(c, 1, ids + [100], checkpoint_at=8)
    hit = compute(c, 2, ids + [200])
    assert hit.num_blocks == 2
    assert c.blocks_of(2)[:2] == c.blocks_of(1)[:2]
    assert c.num_used_blocks == 4  # 2 shared + 1 own each
    c.free(1)
    c.free(2)
    assert c.num_used_blocks == 0 and c.num_cached_blocks == 2  # cached, but free for anyone who needs them
    assert c.match(hashes(ids + [7]), 8).num_blocks == 2
    c.reserve(3, 6 * BS)  # the pool needs every block: the cached ones are evicted, the oldest first
    assert c.num_cached_blocks == 0 and c.prefix.evicted_blocks == 2
    assert c.match(hashes(ids + [7]), 8).num_blocks == 0
    assert c.prefix.num_checkpoints == 0  # the checkpoint went with its block


def test_a_running_sequence_is_never_starved_by_cached_blocks():
    c = cache(blocks=4)
    compute(c, 1, list(range(16)), checkpoint_at=16)
    c.free(1)
    assert c.can_hold(2, 16) and not c.can_hold(2, 17)
    c.reserve(2, 16)
    assert c.num_used_blocks == 4


def test_entries_are_matched_only_after_their_step_ran_and_a_failed_step_forgets_them():
    c = cache()
    ids = list(range(9))
    h = hashes(ids)
    c.reserve(1, 9)
    named = c.name_blocks(1, h, 9)
    slot = c.take_checkpoint(h[1])
    assert slot >= 0 and c.match(h, 8).num_blocks == 0  # pending: the step is still in flight
    c.settle(named, [h[1]], ok=False)
    assert c.num_cached_blocks == 0 and c.prefix.num_checkpoints == 0
    c.free(1)
    assert c.num_used_blocks == 0
    compute(c, 2, ids, checkpoint_at=8)
    assert c.match(h, 8).num_blocks == 2


def test_checkpoints_are_evicted_least_recently_used_within_their_own_slots():
    c = cache(blocks=32, checkpoints=2)
    prompts = [[p] * 8 + [1] for p in range(3)]
    for rid, ids in enumerate(prompts):
        compute(c, rid, ids, checkpoint_at=8)
        c.free(rid)
    assert c.prefix.num_checkpoints == 2 and c.prefix.evicted_checkpoints == 1
    assert c.match(hashes(prompts[0]), 8).num_blocks == 0  # the oldest went
    assert c.match(hashes(prompts[2]), 8).num_blocks == 2


def test_random_admissions_and_frees_keep_every_block_accounted_for():
    rng = random.Random(3)
    c = cache(blocks=40, slots=6, checkpoints=3)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live, hits = set(), 0
    for rid in range(400):
        if live and (len(live) >= 6 or rng.random() < 0.5):
            victim = rng.choice(sorted(live))
            c.free(victim)
            live.discard(victim)
            continue
        ids = rng.choice(stems)[:rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 10))]
        h = hashes(ids)
        hit = c.match(h, len(ids) - 1)
        if not c.can_hold(rid, len(ids), hit):
            continue
        c.reserve(rid, len(ids), hit)
        live.add(rid)
        hits += hit.num_blocks > 0
        ck = (len(ids) // BS) * BS
        named = c.name_blocks(rid, h, len(ids))
        taken = [h[ck // BS - 1]] if ck and c.take_checkpoint(h[ck // BS - 1]) >= 0 else []
        c.settle(named, taken, ok=rng.random() < 0.9)
        held = [b for r in live for b in c.blocks_of(r)]
        refs = {b: held.count(b) for b in held}
        assert all(c._refs[b] == n for b, n in refs.items())
        assert c.num_used_blocks == len(refs)  # a shared block counts once
        assert len(set(c._free)) == len(c._free) and not set(c._free) & set(refs)
        assert not set(c.prefix.evictable) & set(refs)
    assert hits > 0 and c.prefix.evicted_blocks > 0, (hits, c.prefix.evicted_blocks)
