"""YOCO bounded replay (MODEL_V41_SPEC.md §7): in a prefill step the decoder ("consumer") layers, from the first
layer with compress ratio 1 on, only need the last K rows of each sequence.

V4.1's consumer layers read the global context through the KV that the boundary layer projects once for every
token (its ratio-1 compressor and indexer keys: "you only cache once"); otherwise they keep a sliding window. So
per sequence, with `data_len` its full known length (the prompt, or prompt + outputs when a preempted request is
recomputed) and `rect_lo = data_len - K`:
  - mask: every row runs every layer, but in the consumer layers a query's window keys are cut to positions
    >= rect_lo (a query before rect_lo sees only its selected compressed keys and the sink);
  - compact: the encoder side and the boundary layer's shared KV run on all rows, then the consumer layers run
    only the rows >= rect_lo (per chunk at least its last row, kept as a placeholder with an empty window that
    writes no ring row). The kept rows see exactly the keys they see under mask, and every torch op is
    row-invariant, so their results are bitwise mask's.
A decode row is never cut: its window lies inside the last K rows because K >= window + max backtracking.

`BoundedReplay` is the pipeline's `replay` stage (one per run); `plan` turns one step's metadata into a
`ReplayStep` (fixed-shape device tensors from a few host ints per sequence, no loop over tokens), which the model
calls at the boundary layer to switch the rows and metadata the consumer layers run on.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .cache import CachePools, EntryIndex, Selection, StepMeta, WindowIndex
from .cache.metadata import to_device

MODES = ("mask", "compact")


def consumer_boundary(cfg) -> int | None:
    """n_prefill: the first layer with compress ratio 1 (MODEL_V41_SPEC.md §1.3), None if the model has none."""
    return next((i for i, r in enumerate(cfg.compress_ratios) if r == 1), None)


class BoundedReplay:
    """The replay stage: mode `mask` or `compact`, K = `keep_tokens` rows per sequence in the consumer layers."""

    def __init__(self, cfg, mode: str, keep_tokens: int):
        if mode not in MODES:
            raise ValueError(f"replay mode {mode!r}; allowed: {', '.join(MODES)}")
        boundary = consumer_boundary(cfg)
        if boundary is None:
            raise ValueError(f"yoco={mode} needs YOCO decoder layers (a layer with compress ratio 1); this model "
                             f"has none (compress_ratios={list(cfg.compress_ratios)})")
        late = [s for s in cfg.kv_source_layer_ids if s > boundary]
        if late:
            # compact computes a consumer layer's compressor on kept rows only: the shared KV would have holes
            raise ValueError(f"yoco={mode} needs the boundary layer {boundary} to be the decoder layers' only KV "
                             f"source; layers {late} are KV sources after it")
        early = [t for t in cfg.dspark_target_layer_ids if t <= boundary] if cfg.num_nextn_predict_layers else []
        if mode == "compact" and early:
            # DSpark's context rows are the streams entering its target layers: all must be the kept rows, and
            # the streams entering the boundary layer are still every row
            raise ValueError(f"yoco=compact needs the DSpark target layers after the boundary layer {boundary}; "
                             f"found {early} (use yoco=mask)")
        self.mode, self.keep, self.boundary = mode, int(keep_tokens), boundary
        self.window = cfg.sliding_window
        self.num_consumer_layers = cfg.num_hidden_layers - boundary

    def applies(self, lengths: list[int], pasts: list[int], data_lens: list[int]) -> bool:
        """Whether the rectangle cuts any row's window in this step: some sequence's oldest window key of the step
        lies before its rect_lo. Decode rows never qualify (their window lies in the last K rows)."""
        return any(d - self.keep > max(0, p - self.window + 1) for p, d in zip(pasts, data_lens))

    def clips(self, lengths: list[int], pasts: list[int], data_lens: list[int]) -> list[int]:
        """Per sequence: how many leading rows of its chunk lie before the keep rectangle (the chunk's last row is
        always kept)."""
        return [min(max(d - self.keep - p, 0), n - 1) for n, p, d in zip(lengths, pasts, data_lens)]

    def rows_saved(self, lengths: list[int], pasts: list[int], data_lens: list[int]) -> int:
        """Decoder-layer rows not computed (rows x consumer layers): compact only; mask computes every row."""
        if self.mode != "compact":
            return 0
        return sum(self.clips(lengths, pasts, data_lens)) * self.num_consumer_layers

    def prompt_logprobs_error(self) -> str:
        """Why a request asking for prompt logprobs is refused (DeepInfer forces them off under truncation)."""
        why = ("compact does not compute the decoder layers for the prompt rows before them" if self.mode == "compact"
               else "mask cuts the windows of the prompt rows before them, so their logprobs would be wrong")
        return (f"prompt_logprobs are unavailable under YOCO prefill truncation (yoco={self.mode}, "
                f"keep_tokens={self.keep}: the decoder layers replay only the last {self.keep} rows; {why}); "
                f"use yoco=off for prompt logprobs")

    def plan(self, meta: StepMeta, pools: CachePools, pasts: list[int], data_lens: list[int] | None) -> "ReplayStep":
        """The step's consumer-layer view (built once, before the layers run). `data_lens` None: each sequence
        ends with this chunk."""
        lengths = meta.host.lengths
        if data_lens is None:
            data_lens = [p + n for p, n in zip(pasts, lengths)]
        dev = meta.positions.device
        rect_lo = to_device([d - self.keep for d in data_lens], dev)
        if self.mode == "mask":
            return ReplayStep(self.boundary, _mask_view(meta, rect_lo, self.window), None, None)
        if "last" not in meta.host.base:
            raise ValueError("yoco=compact cannot return logits of every row (the consumer layers skip the rows "
                             "before the keep rectangle); use yoco=mask or off for all-row logits")
        clips = self.clips(lengths, pasts, data_lens)
        view, kept = _compact_view(meta, pools, rect_lo, to_device(clips, dev), sum(lengths) - sum(clips),
                                   self.window, self.boundary)
        return ReplayStep(self.boundary, view, kept, self.boundary)


class ReplayStep:
    """One step's switch at the boundary layer (`enter`)."""

    def __init__(self, boundary: int, view: StepMeta, kept: torch.Tensor | None, shared_kv_layer: int | None):
        self.boundary, self.view, self.kept, self.shared_kv_layer = boundary, view, kept, shared_kv_layer

    def enter(self, model, streams, pre, meta: StepMeta, pools: CachePools, hash_ids):
        """Called by the model before the boundary layer's block: returns the streams, pre-mix, metadata and Engram
        hash ids the consumer layers run on. Compact first writes the boundary layer's shared KV (compressed KV
        and indexer keys) for every row, from its attention-norm output of all rows."""
        view, kept = self.view, self.kept
        # the consumer layers go on from what the layers before the boundary selected (on the kept rows)
        view.selected, view.candidates = meta.selected, meta.candidates
        if kept is None:
            return streams, pre, view, hash_ids
        attn = model.attn[self.boundary]
        if attn.is_source:
            attn.compress(model.attn_input(streams, pre, model.layers[self.boundary]), meta, pools)
        if view.selected is not None:
            view.selected = Selection(view.selected.source, view.selected.rows[kept])
        if view.candidates is not None:
            view.candidates = view.candidates[kept]
        return streams[kept], pre[kept], view, (hash_ids[kept] if hash_ids is not None else None)


def _window_look(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[T, W] the positions of each query's window keys (oldest first), as models/cache/metadata.py lays them."""
    return positions[:, None] - (window - 1) + torch.arange(window, device=positions.device)[None, :]


def _mask_view(meta: StepMeta, rect_lo: torch.Tensor, window: int) -> StepMeta:
    wi = meta.window
    inside = _window_look(meta.positions, window) >= rect_lo[meta.tok_seq][:, None]
    # the prefill (slate) path also for steps of one-token chunks: the decode path reads visibility from the ring
    host = replace(meta.host, decode_only=False, split=None)
    valid, is_new, ring_row, new_row = wi.slates()
    window = WindowIndex(valid & inside, is_new, ring_row, new_row, wi.write_row)
    return replace(meta, host=host, window=window, prefill_window=None)


def _compact_view(meta: StepMeta, pools: CachePools, rect_lo, clip, total: int, window: int, shared: int):
    """The consumer layers' metadata over the kept rows, and the kept rows' indices in the full layout."""
    dev = meta.positions.device
    lengths = meta.host.base["lengths"]
    starts = torch.cumsum(lengths, 0) - lengths
    keep_len = lengths - clip
    cu = torch.cumsum(keep_len, 0)
    j = torch.arange(total, device=dev)
    seq = torch.searchsorted(cu, j, right=True)
    offset = starts + clip - (cu - keep_len)  # full row - compact row, per sequence
    kept = j + offset[seq]

    pos, tok_seq = meta.positions[kept], meta.tok_seq[kept]
    lo = rect_lo[tok_seq]
    wi = meta.window
    valid, is_new, ring_row, new_row = wi.slates()
    trash = pools.slots_alloc * pools.layout.ring
    window_c = WindowIndex(
        valid=valid[kept] & (_window_look(pos, window) >= lo[:, None]),
        is_new=is_new[kept],
        ring_row=ring_row[kept],
        # keys of this step are rows >= rect_lo of the same chunk, all kept: renumber them (masked ones clamp)
        new_row=(new_row[kept] - offset[tok_seq][:, None]).clamp(0, total - 1),
        write_row=torch.where(pos >= lo, wi.write_row[kept], trash),  # the placeholder writes no ring row
    )
    entries = {r: EntryIndex(e.rows, e.visible[kept], e.width) for r, e in meta.entries.items()}
    base = dict(meta.host.base)
    last = base["last"]
    base["last"] = last - offset[meta.tok_seq[last]]
    host = replace(meta.host, decode_only=False, split=None, base=base)
    # no compression groups / entry rows: the only KV source of the consumer layers (the boundary) has written
    # every row before the switch (`shared_kv_written`), so no consumer layer compresses
    view = StepMeta(host, meta.ids[kept], pos, tok_seq, meta.tok_slot[kept], meta.slots, window_c,
                    entries=entries, shared_kv_written=(shared,))
    return view, kept
