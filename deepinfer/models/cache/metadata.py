"""One step's metadata: built once per step from the batch, then read by every layer (no loop over sequences).

The host packs a few small integer tensors (token ids, positions, which sequence each token belongs to, slots,
tokens held before the step, block tables) and copies them to the device once; everything else is derived from
them on the device with fixed shapes, so the same derivation can run inside a captured CUDA graph:
  - window: for each query, where each of its `window` keys is (the slot's ring or this step's new rows; not on a
    decode-only step as stored, whose attention reads the ring itself), and the ring row each new token is written
    to (only the last `ring` tokens of a sequence: no two writes collide);
  - compression (per ratio > 1): every token at the end of a group closes it: the group's member rows (open-group
    ring or new rows) and the pool row of the new entry; other tokens write to the trash row;
  - entries (per ratio): the pool rows of every entry of each sequence, and how many each query may see;
  - Engram: the compressed token ids each new token looks back over;
  - images (a prefill step over image spans only): the embedding rows that replace the span positions' rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from deepinfer.sampling.queued_copy import queued

from .pools import CacheLayout, CachePools


def block_table(seqs, width: int, fill: int) -> torch.Tensor:
    """[len(seqs), width] int64 (host) of each sequence's cache blocks, `fill` past its last. Row by row through
    numpy: torch.tensor of a list of lists took ~25 ms a step at 256 sequences x 513 blocks (32K tokens) on one
    CPU core, on the step's critical path, where this takes ~3."""
    tab = np.full((len(seqs), width), fill, dtype=np.int64)
    for i, s in enumerate(seqs):
        n = min(len(s.blocks), width)
        if n:
            tab[i, :n] = s.blocks[:n]
    return torch.from_numpy(tab)


def to_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """values (a list, or a host tensor) on `device`, queued in stream order (no wait for the GPU to drain)."""
    return queued(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype), device)


@dataclass
class HostStep:
    """What the host knows about a step (plain ints), and the base tensors it copies to the device."""

    lengths: list[int]  # new tokens of each sequence
    decode_only: bool  # the decode attention path: one token per sequence, or a verification (pack_step)
    max_entries: dict[int, int]  # ratio -> entries the widest sequence holds after the step
    base: dict[str, torch.Tensor]  # on the device: ids, positions, tok_seq, slots, past, lengths, table
    # a step that mixes decoding sequences with prefill chunks: (rows of the decoding sequences, the other rows),
    # on the device; the decoding rows take the decode attention path as they would in a decode-only step
    split: tuple[torch.Tensor, torch.Tensor] | None = None
    # sequences whose rows take the prefill attention path (pack_step sets it; None: no such path planned, e.g.
    # a captured graph's step): their window keys are gathered once per step into a PrefillWindow
    prefill_seqs: list[int] | None = None


def pack_step(token_ids: list[list[int]], seqs, layout: CacheLayout, device, all_logits: bool = False,
              num_logits: list[int] | None = None, decode_rows: list[bool] | None = None) -> HostStep:
    """The base tensors of a step (a captured graph fills its own static ones); `all_logits` keeps every row's
    logits, `num_logits` the last num_logits[i] rows of sequence i (else its last row: base["last"]);
    `decode_rows` (ForwardBatch.decode_rows): which sequences bring generated tokens."""
    lengths = [len(t) for t in token_ids]
    past = [s.num_tokens for s in seqs]
    starts, acc = [], 0
    for n in lengths:
        starts.append(acc)
        acc += n
    for s, p, n in zip(seqs, past, lengths):
        if p + n > s.capacity:
            raise ValueError(f"sequence in slot {s.slot} holds {len(s.blocks)} blocks ({s.capacity} tokens); "
                             f"the step needs {p + n}")
    mb = max(1, max(len(s.blocks) for s in seqs))
    table = block_table(seqs, mb, 0)
    ratios = {src.ratio for src in layout.sources.values()}
    max_entries = {r: max((p + n) // r for p, n in zip(past, lengths)) for r in ratios}
    base = {
        "ids": to_device([t for ids in token_ids for t in ids], device),
        "positions": to_device([p + j for p, n in zip(past, lengths) for j in range(n)], device),
        "tok_seq": to_device([i for i, n in enumerate(lengths) for _ in range(n)], device),
        "slots": to_device([s.slot for s in seqs], device),
        "past": to_device(past, device),
        "lengths": to_device(lengths, device),
        "table": to_device(table, device),
    }
    if not all_logits:
        keep = num_logits or [1] * len(lengths)
        base["last"] = to_device([st + n - c + j for st, n, c in zip(starts, lengths, keep) for j in range(c)], device)
    # the decode attention path (reads the rings as stored): one new token per sequence, or a verification (the
    # anchor and its drafts, logits for each) that fits the rollback rows, so its writes never hide a window key
    decoding = [n == 1 or (num_logits is not None and n <= layout.max_rollback) for n in lengths]
    if decode_rows is not None:
        decoding = [d and g for d, g in zip(decoding, decode_rows)]
    split = None
    if decode_rows is not None and any(decoding) and not all(decoding):
        rows = [[], []]
        for st, n, d in zip(starts, lengths, decoding):
            rows[0 if d else 1].extend(range(st, st + n))
        split = (to_device(rows[0], device), to_device(rows[1], device))
    # the rows _attend sends to the prefill path: none in a decode-only step, the other rows of a split step,
    # else every row
    if all(decoding):
        prefill = []
    else:
        prefill = [i for i, d in enumerate(decoding) if not d] if split is not None else list(range(len(lengths)))
    return HostStep(lengths, all(decoding), max_entries, base, split, prefill)


@dataclass
class WindowIndex:
    # each query's window keys as a slate: read them through slates() (a decode-only step as stored derives them
    # only if something asks, e.g. a YOCO view built over it: its decode op reads the ring itself)
    valid: torch.Tensor | None  # [T, W] the key position exists (>= 0)
    is_new: torch.Tensor | None  # [T, W] it is one of this step's tokens (else it is in the ring)
    ring_row: torch.Tensor | None  # [T, W]
    new_row: torch.Tensor | None  # [T, W]
    write_row: torch.Tensor  # [T] ring row of each new token (trash: overwritten later in the same step)
    build: Any = None  # () -> (valid, is_new, ring_row, new_row), for slates not derived yet

    def slates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(valid, is_new, ring_row, new_row), derived now if the step did not."""
        if self.valid is None:
            self.valid, self.is_new, self.ring_row, self.new_row = self.build()
            self.build = None
        return self.valid, self.is_new, self.ring_row, self.new_row


@dataclass
class GroupIndex:
    """Compression groups of one ratio > 1 closed by this step's tokens (one candidate per token)."""

    closes: torch.Tensor  # [T] bool
    member_is_new: torch.Tensor  # [T, r]
    member_open_row: torch.Tensor  # [T, r] open-group ring row (when not new)
    member_new_row: torch.Tensor  # [T, r]
    entry_row: torch.Tensor  # [T] pool row of the entry it closes (trash if none)
    rope_pos: torch.Tensor  # [T] the group's first position
    open_write_row: torch.Tensor  # [T]


@dataclass
class EntryIndex:
    rows: torch.Tensor  # [B, G] pool row of entry g of sequence b (g beyond its count: row of a valid block)
    visible: torch.Tensor  # [T] entries query t may see: (p + 1) // ratio
    width: int  # G

    @cached_property
    def visible32(self) -> torch.Tensor:
        """`visible` as int32 (the GPU kernels' index type), cast once for every layer that scores or selects."""
        return self.visible.to(torch.int32)


@dataclass
class Selection:
    """What an indexing layer hands the layers after it: each query's selected compressed-KV pool rows."""

    source: int  # the KV-source layer whose compressed pool the rows address
    rows: torch.Tensor  # [T, index_topk] pool rows (-1: unused slot)


@dataclass
class PrefillWindow:
    """The window keys of a step's prefill rows as per-sequence strips instead of per-query slates: strip i holds
    prefill sequence i's last `window` ring rows from before the step and its new rows, position p at strip row
    p % width (width >= window + its longest chunk, so no two positions collide), and `pos` the position each
    strip row holds (-1: none). Each layer fills the strips (one gather of packed FP8 rows per sequence and token,
    not `window` bf16 keys per query), then its queries read them as the decode path reads a ring."""

    rows: torch.Tensor | None  # [Tp] the step rows on the prefill path (None: every row)
    seq: torch.Tensor  # [Tp] int32 strip of each such row
    width: int
    hist_src: torch.Tensor  # [Bp * window] ring rows of the history (any valid row where the position is < 0)
    hist_dst: torch.Tensor  # [Bp * window] their strip rows (the trash row Bp * width where the position is < 0)
    new_dst: torch.Tensor  # [Tp] strip row of each prefill row's own key
    pos: torch.Tensor  # [Bp, width] int32
    buffers: dict = field(default_factory=dict)  # the strips' packed rows, allocated once per step

    def strips(self, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Zeroed [Bp * width + 1, ...] buffers shaped like the ring parts `like` (codes, scales); every layer
        overwrites the same rows, the others stay zero (masked keys that decode to finite values)."""
        key = tuple((t.shape[1:], t.dtype) for t in like)
        if key not in self.buffers:
            n = self.pos.numel() + 1
            self.buffers[key] = tuple(torch.zeros(n, *t.shape[1:], dtype=t.dtype, device=t.device) for t in like)
        return self.buffers[key]


@dataclass
class ImageRows:
    """The image-span rows of a prefill step (VISION_SPEC.md §6.2): row j of `rows` replaces the embedding of step
    row `index[j]`. Span positions carry ids >= vocab_size, which is how the layers find them (bias_vl routing,
    Engram dead tokens) without another per-row tensor: the ids follow every view of the step (YOCO, context
    parallel)."""

    index: torch.Tensor  # [k] int64 step rows
    rows: torch.Tensor  # [k, hidden]


@dataclass
class StepMeta:
    host: HostStep
    ids: torch.Tensor
    positions: torch.Tensor
    tok_seq: torch.Tensor
    tok_slot: torch.Tensor
    slots: torch.Tensor
    window: WindowIndex
    groups: dict[int, GroupIndex] = field(default_factory=dict)  # ratio -> index (ratio > 1)
    entry_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # ratio -> [T] pool row of entry p // r
    entries: dict[int, EntryIndex] = field(default_factory=dict)
    ngram: tuple | None = None  # (valid, is_new, ring_row, new_row) [T, n], write_row [T]
    # what the layers hand each other within the step (a new StepMeta per step starts them empty): the latest
    # indexing layer's selection, read by the layers that share its KV source, and the candidate source's
    # candidate blocks [T, candidate_topk_blocks], which the Reindex layers after it select within
    selected: Selection | None = None
    candidates: torch.Tensor | None = None
    # KV-source layers whose compressor already wrote every row of the step: YOCO compact's consumer view
    # (models/replay.py) runs the boundary layer on fewer rows after its shared KV was written for all of them
    shared_kv_written: tuple[int, ...] = ()
    # context-parallel prefill (deepinfer.distributed.context_parallel.CPStep): this view's rows are the rank's own
    # queries; cp.full is the whole step's metadata, which the cache writes use, and cp.gather brings other ranks' rows
    cp: Any = None
    # the prefill rows' window strips (None: slates; views that change the rows or the window set it to None)
    prefill_window: PrefillWindow | None = None
    # a prefill step whose new tokens include image-span positions; None for every other step (text-only steps run
    # exactly as before: no mask, no merge)
    images: ImageRows | None = None

    # int32 copies of the per-token metadata the GPU kernels index with, made once per step (inside a captured
    # decode graph: once per replay) instead of by every layer's launcher
    @cached_property
    def tok_slot32(self) -> torch.Tensor:
        return self.tok_slot.to(torch.int32)

    @cached_property
    def tok_seq32(self) -> torch.Tensor:
        return self.tok_seq.to(torch.int32)

    @cached_property
    def positions32(self) -> torch.Tensor:
        return self.positions.to(torch.int32)


def derive(host: HostStep, pools: CachePools) -> StepMeta:
    """Everything the layers read, from the base tensors; fixed shapes given the host ints (graph-capturable)."""
    layout, S = pools.layout, pools.slots_alloc
    b = host.base
    dev = b["ids"].device
    pos, tok_seq, slots, table = b["positions"], b["tok_seq"], b["slots"], b["table"]
    starts = torch.cumsum(b["lengths"], 0) - b["lengths"]
    tok_slot, tok_past = slots[tok_seq], b["past"][tok_seq]
    tok_end, tok_start = (b["past"] + b["lengths"])[tok_seq], starts[tok_seq]

    def ring_index(look: torch.Tensor, rows: int):
        """For positions `look` [T, k] of each token's own sequence: (valid, is_new, ring row, new row)."""
        return (look >= 0, *ring_rows(look, rows))

    def ring_rows(look: torch.Tensor, rows: int):
        """ring_index without `valid`: (is_new, ring row, new row)."""
        is_new = look >= tok_past[:, None]
        ring = tok_slot[:, None] * rows + torch.remainder(look, rows)
        new = (tok_start[:, None] + look - tok_past[:, None]).clamp_min(0)
        return is_new, ring, new

    # the ring row of each new token in every ring the step writes (layout.write_rings; row i of [rings, T] for the
    # i-th), or the ring's trash row when a later token of the step takes the same row: one pass for all rings
    rings, trash = pools.write_ring_rows, pools.write_ring_trash
    write = torch.where(pos[None, :] >= tok_end[None, :] - rings, tok_slot[None, :] * rings
                        + torch.remainder(pos[None, :], rings), trash)
    write_row = dict(zip(layout.write_rings, write))

    W, R = layout.window, layout.ring

    def window_slates():
        return ring_index(pos[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :], R)

    if host.decode_only and layout.as_stored:
        # the decode op reads each query's window from the ring as stored: the [T, W] slates only if asked for (in a
        # captured decode graph, eleven launches fewer)
        window = WindowIndex(None, None, None, None, write_row["window"], build=window_slates)
    else:
        window = WindowIndex(*window_slates(), write_row["window"])
    meta = StepMeta(host, b["ids"], pos, tok_seq, tok_slot, slots, window)
    last_block = table.shape[1] - 1
    closes = {}  # ratio -> [T] the token closes a group (ends an entry)
    for src in layout.sources.values():
        r, pb = src.ratio, src.per_block
        trash = pools.blocks_alloc * pb
        if r not in meta.entry_rows:
            ent = pos // r
            closes[r] = torch.remainder(pos + 1, r) == 0
            meta.entry_rows[r] = torch.where(closes[r], table[tok_seq, (ent // pb).clamp_max(last_block)] * pb
                                             + ent % pb, trash)
            G = host.max_entries[r]
            g = torch.arange(G, device=dev)
            rows = table[:, (g // pb).clamp_max(last_block)] * pb + (g % pb)[None, :]
            meta.entries[r] = EntryIndex(rows, (pos + 1) // r, G)
        if r > 1 and r not in meta.groups:
            look = pos[:, None] - (r - 1) + torch.arange(r, device=dev)[None, :]
            meta.groups[r] = GroupIndex(closes[r], *ring_rows(look.clamp_min(0), src.open_rows), meta.entry_rows[r],
                                        pos - (r - 1), write_row[r])
    if layout.ngram_rows:
        n = layout.cfg.engram_max_ngram_size
        look = pos[:, None] - torch.arange(n, device=dev)[None, :]  # look-back 0..n-1
        meta.ngram = (ring_index(look, layout.ngram_rows), write_row["ngram"])
    if host.prefill_seqs and layout.as_stored:  # the decode op reads the strips as it reads a ring
        meta.prefill_window = _prefill_window(host, pos, tok_seq, slots, layout)
    return meta


def _prefill_window(host: HostStep, pos, tok_seq, slots, layout: CacheLayout) -> PrefillWindow:
    dev = pos.device
    W, R = layout.window, layout.ring
    seqs = host.prefill_seqs
    n = len(seqs)
    # a power of two: few distinct shapes (the decode kernel compiles one per strip width)
    width = max(64, 1 << (W + max(host.lengths[i] for i in seqs) - 1).bit_length())
    ps = to_device(seqs, dev)
    strip_of = torch.full((len(host.lengths),), -1, dtype=torch.int64, device=dev)
    strip_of[ps] = torch.arange(n, device=dev)
    rows = host.split[1] if host.split is not None else None
    r_pos = pos if rows is None else pos[rows]
    r_strip = strip_of[tok_seq if rows is None else tok_seq[rows]]
    hist = host.base["past"][ps][:, None] - W + torch.arange(W, device=dev)[None, :]  # [n, W]
    starts = torch.arange(n, device=dev)[:, None] * width
    hist_dst = torch.where(hist >= 0, starts + torch.remainder(hist, width), n * width).reshape(-1)
    hist_src = (slots[ps][:, None] * R + torch.remainder(hist, R)).reshape(-1)
    new_dst = r_strip * width + torch.remainder(r_pos, width)
    spos = torch.full((n * width + 1,), -1, dtype=torch.int32, device=dev)
    spos.index_copy_(0, hist_dst, hist.reshape(-1).to(torch.int32))
    spos.index_copy_(0, new_dst, r_pos.to(torch.int32))
    spos[n * width] = -1
    return PrefillWindow(rows, r_strip.to(torch.int32), width, hist_src, hist_dst, new_dst,
                         spos[: n * width].view(n, width))


def query_view(meta: StepMeta, rows: torch.Tensor, cp: Any) -> StepMeta:
    """The metadata of a context-parallel rank's queries: the step rows `rows` of `meta` (their ids, positions,
    window slates, visible entries). Window slates still point at the whole step's rows (`new_row`: the gathered
    keys) and `window.write_row` stays the whole step's, so each rank writes every row's window KV into its own
    rings; compression groups, entry rows and the Engram look-back are read from `cp.full` (= meta) only."""
    wi = meta.window
    window = WindowIndex(*(t[rows] for t in wi.slates()), wi.write_row)
    entries = {r: EntryIndex(e.rows, e.visible[rows], e.width) for r, e in meta.entries.items()}
    return replace(meta, ids=meta.ids[rows], positions=meta.positions[rows], tok_seq=meta.tok_seq[rows],
                   tok_slot=meta.tok_slot[rows], window=window, groups={}, entry_rows={}, entries=entries, ngram=None,
                   selected=None, candidates=None, cp=cp, prefill_window=None)
