"""V4.1 attention for one layer over a packed batch: low-rank Q, one shared K = V latent over a sliding window,
and on compressed layers the shared compressed KV chosen by the lightning indexer (MODEL_V41_SPEC.md §4.4–4.7).

Every query attends to a fixed-width key list: `window` slots (positions p-W+1 .. p, oldest first) followed by
`index_topk` slots for the selected compressed entries (ascending entry order), unused slots masked. The list
depends only on the query's own position, so a row's result does not depend on what it is batched with or how
its prompt was chunked. With the caches in the released formats every query goes through the decode attention op,
which reads the keys as stored: decoding rows from the ring, prefill rows from their sequence's window strip
(StepMeta.prefill_window: the ring's history plus the step's new rows, gathered once per layer). Other layouts, the
YOCO views and context parallel build per-query bf16 slates of the same keys in the same order. Where the keys
live (which ring row, which pool row) is the step metadata's business (models/cache); this file only says what is
computed.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.torch.cache_formats import Fp4Codec, Fp8Codec

from .cache import CachePools, PrefillWindow, Selection, StepMeta
from .weights import Attention as AttentionWeights


class Attention:
    def __init__(self, cfg, layer: int, w: AttentionWeights, ops, rope_freqs: torch.Tensor,
                 compress_freqs: torch.Tensor):
        self.cfg, self.layer, self.w, self.ops = cfg, layer, w, ops
        self.ratio = cfg.compress_ratios[layer]
        self.freqs = compress_freqs if self.ratio else rope_freqs
        self.compress_freqs = compress_freqs
        self.is_source = layer in cfg.kv_source_layer_ids
        self.is_index = layer in cfg.index_source_layer_ids
        self.is_candidate_source = layer == cfg.candidate_source_layer_id
        self.uses_candidates = 0 <= cfg.candidate_source_layer_id < layer
        self.source = cfg.kv_source_of(layer)
        self.scale = cfg.head_dim**-0.5

    # ---------------------------------------------------------------------------------------
    def __call__(self, h: torch.Tensor, meta: StepMeta, pools: CachePools) -> torch.Tensor:
        cfg, w, ops = self.cfg, self.w, self.ops
        T = h.shape[0]
        q_res = ops.rms_norm(ops.linear(h, w.wq_a), w.q_norm, cfg.rms_norm_eps)
        # in place: the projection's output is this step's alone (the rope launch then moves only rotated bytes)
        q = ops.rope(ops.linear(q_res, w.wq_b).view(T, cfg.num_attention_heads, cfg.head_dim), meta.positions,
                     self.freqs, inplace=True)
        kv = ops.linear(h, w.wkv)
        cp = meta.cp
        if pools.layout.as_stored and meta.host.decode_only and cp is None:
            # a decode step reads its window back from the ring (_attend_decode): the norm, rope, FP8 encode and
            # ring writes as one op (one launch on the GPU, five unfused)
            ops.window_kv(kv, w.kv_norm, cfg.rms_norm_eps, meta.positions, self.freqs, *pools.window[self.layer],
                          meta.window.write_row)
            kv = kv_parts = None
        else:
            kv, kv_parts = self._window_kv(kv, meta, pools, h.dtype)
        compressing = self.ratio and self.is_source and self.layer not in meta.shared_kv_written
        c_in = self.compress_input(h) if compressing else None
        if cp is not None:  # context parallel: the whole step's window KV and compressor input, from every rank
            *kv_parts, c_in = cp.gather(*kv_parts, c_in)
            kv = pools.layout.win_codec.decode(*kv_parts, dtype=h.dtype)

        if self.ratio:
            if compressing:
                self.store_compressed(c_in, meta if cp is None else cp.full, pools, h.dtype)
            if self.is_index:
                self._index(h, q_res, meta, pools)
        out = self._attend(q, kv, kv_parts, meta, pools)
        out = ops.rope(out, meta.positions, self.freqs, inverse=True, inplace=True)
        # grouped low-rank output projection: group g holds heads [g*H/G, (g+1)*H/G)
        grouped = out.reshape(T, cfg.o_groups, -1)
        y = ops.grouped_linear(grouped, w.wo_a)
        return ops.linear(y, w.wo_b)

    def _window_kv(self, kv, meta: StepMeta, pools: CachePools, dtype: torch.dtype):
        """(the step's window KV as the cache holds it, its codec parts) from the wkv projection: the window KV is
        cached in FP8 (the model's own fake quantisation), and this step uses what the cache holds."""
        ops, cfg = self.ops, self.cfg
        kv = ops.rope(ops.rms_norm(kv, self.w.kv_norm, cfg.rms_norm_eps), meta.positions, self.freqs)
        codec = pools.layout.win_codec
        if isinstance(codec, Fp8Codec):  # parts and their decoded values in one op (one launch on the GPU)
            *kv_parts, kv_q = ops.encode_fp8(kv)
            return kv_q.to(dtype), kv_parts
        kv_parts = list(codec.encode(kv))
        return codec.decode(*kv_parts, dtype=dtype), kv_parts

    # ---------------------------------------------------------------------------------------
    def compress(self, h: torch.Tensor, meta: StepMeta, pools: CachePools) -> None:
        """Close the compression groups this step's tokens complete and store their entries (and indexer keys).
        Every token is a candidate group end; those that end no group write to the trash row. Public: YOCO compact
        (models/replay.py) runs it over every row of the boundary layer before the consumer layers drop rows."""
        self.store_compressed(self.compress_input(h), meta, pools, h.dtype)

    def compress_input(self, h: torch.Tensor) -> torch.Tensor:
        """The compressor's per-token part (what context parallel gathers): ratio 1 the normed latent [T, D];
        ratio > 1 the fp32 (kv, gate) projections [T, 2, D]."""
        cfg, c, ops = self.cfg, self.w.compressor, self.ops
        if self.ratio == 1:
            return ops.rms_norm(ops.linear(h, c.wkv), c.norm, cfg.rms_norm_eps)
        hf = h.float()  # one cast for both projections (their weights fp32 since loading: weights.py)
        return torch.stack([ops.linear(hf, c.wkv.float()), ops.linear(hf, c.wgate.float())], 1)

    def store_compressed(self, c_in: torch.Tensor, meta: StepMeta, pools: CachePools, dtype: torch.dtype) -> None:
        """compress() from the compressor input of every row of `meta`'s step."""
        cfg, w, ops, L = self.cfg, self.w, self.ops, pools.layout
        if self.ratio == 1:  # every token is its own group
            latent = c_in
            pos, dst = meta.positions, meta.entry_rows[1]
        else:
            r, T, D = self.ratio, c_in.shape[0], cfg.head_dim
            gi = meta.groups[r]
            raw = c_in
            held = pools.open_groups[self.layer]  # [slots * rows + 1, 2, D] fp32 (kv, gate)
            members = torch.where(gi.member_is_new[..., None, None], raw[gi.member_new_row], held[gi.member_open_row])
            held.index_copy_(0, gi.open_write_row, raw)  # after the read: a write may reuse a row just read
            pooled = ops.compressor_pool(members[:, :, 0].reshape(T * r, D), members[:, :, 1].reshape(T * r, D), r)
            latent = ops.rms_norm(pooled.to(dtype), w.compressor.norm, cfg.rms_norm_eps)
            pos, dst = gi.rope_pos, gi.entry_row
        if self.is_index:  # indexer keys come from the pre-RoPE latent
            k = ops.rope(ops.rms_norm(ops.linear(latent, w.indexer.wk), w.indexer.k_norm, cfg.rms_norm_eps), pos,
                         self.compress_freqs)
            for part, new in zip(pools.index_keys[self.layer], self._encode(L.key_codec, k)):
                part.index_copy_(0, dst, new)
        for part, new in zip(pools.compressed[self.layer],
                             self._encode(L.cmp_codec, ops.rope(latent, pos, self.compress_freqs))):
            part.index_copy_(0, dst, new)

    def _encode(self, codec, x: torch.Tensor):
        """codec.encode(x); the FP4 codecs through the encode_fp4 op (one launch on the GPU, ~15 torch ops
        otherwise)."""
        if isinstance(codec, Fp4Codec):
            return self.ops.encode_fp4(x, codec.block, codec.e4m3_scales)
        return codec.encode(x)

    def _index(self, h: torch.Tensor, q_res: torch.Tensor, meta: StepMeta, pools: CachePools) -> None:
        """Score every query against its sequence's indexer keys; publish each query's selected pool rows."""
        cfg, w, ops, L = self.cfg, self.w, self.ops, pools.layout
        T, topk = h.shape[0], cfg.index_topk
        iq = ops.linear(q_res, w.indexer.wq_b).view(T, cfg.index_n_heads, cfg.index_head_dim)
        iq = ops.fake_quant_fp4(ops.rope(iq, meta.positions, self.compress_freqs, inplace=True), 32, False)
        weights = ops.linear(h, w.indexer.weights_proj).float() * cfg.index_n_heads**-0.5
        ent = meta.entries[self.ratio]
        if ent.width == 0:  # nothing compressed yet in any sequence of the step
            meta.selected = Selection(self.source, torch.full((T, topk), -1, dtype=torch.int32, device=h.device))
            return
        if isinstance(L.key_codec, Fp4Codec):  # the keys read where the pool holds them, through the entry rows
            scores = ops.indexer_scores_fp4(iq, meta.tok_seq32, ent.visible32, *pools.index_keys[self.source],
                                            ent.rows, weights, cfg.index_head_dim**-0.5)
        else:
            stored = [p[ent.rows] for p in pools.index_keys[self.source]]  # [B, G, ...] each sequence's keys
            keys = L.key_codec.decode(*stored, dtype=torch.float32)
            scores = ops.indexer_scores(iq, keys, meta.tok_seq, weights, cfg.index_head_dim**-0.5)
        blocks = cfg.candidate_topk_blocks if self.is_candidate_source else 0
        # the selected entries in ascending entry order as pool rows, -1 padded; int32, the kernels' index type, so
        # no layer that reads the selection casts it again
        rows = ops.index_topk_rows(
            scores,
            ent.visible32,
            topk,
            ent.rows,
            meta.tok_seq32,
            candidates=meta.candidates if self.uses_candidates else None,
            candidate_blocks=blocks,
            candidate_block_size=cfg.candidate_block_size,
        )
        if blocks > 0:
            rows, meta.candidates = rows
        elif self.is_candidate_source:
            meta.candidates = None
        meta.selected = Selection(self.source, rows)

    # ---------------------------------------------------------------------------------------
    def _attend(self, q, kv, kv_parts, meta: StepMeta, pools: CachePools) -> torch.Tensor:
        as_stored = pools.layout.as_stored
        if as_stored and meta.host.decode_only:
            return self._attend_decode(q, kv_parts, meta, pools)
        split = meta.host.split if as_stored else None
        # the prefill rows read the rings before this step's writes, the decode path after them
        if meta.prefill_window is not None and meta.cp is None:  # built only for layouts as stored
            prefill = self._attend_strips(q, kv_parts, meta, pools, meta.prefill_window)
        else:
            prefill = self._attend_slates(q, kv, meta, pools, None if split is None else split[1])
        if split is None:
            self._write_window(kv_parts, meta, pools)
            return prefill
        # decoding sequences beside prefill chunks: the decoding rows as in a decode-only step
        dec, pre = split
        out = torch.empty_like(q)
        out.index_copy_(0, pre, prefill)
        out.index_copy_(0, dec, self._attend_decode(q, kv_parts, meta, pools, dec))
        return out

    def _selected(self, meta: StepMeta, T: int, device) -> torch.Tensor:
        """[T, index_topk] pool rows each query attends to (-1: none), from this step's index source."""
        selected = meta.selected
        if selected is not None and selected.source == self.source:
            return selected.rows
        # without an index source for this source in this step, nothing is selectable
        return torch.full((T, self.cfg.index_topk), -1, dtype=torch.int32, device=device)

    def _pool_keys(self, meta: StepMeta, pools: CachePools, T: int, device):
        """(the [T, index_topk] selected pool rows, the compressed pool's codes and scales) the decode op reads; no
        selection and an empty pool on an uncompressed layer."""
        if self.ratio:
            return (self._selected(meta, T, device), *pools.compressed[self.source])
        return (torch.empty(T, 0, dtype=torch.int32, device=device), *pools.no_compressed)

    def _attend_slates(self, q, kv, meta: StepMeta, pools: CachePools, rows: torch.Tensor | None = None):
        """Every query (or the queries `rows`) over its key slate, gathered from the rings before this step writes
        them and from this step's new rows."""
        ops, L = self.ops, pools.layout
        ring = pools.window[self.layer]
        wi = meta.window
        valid, is_new, ring_row, new_row = wi.slates()
        if rows is not None:
            q, ring_row, is_new, new_row, valid = q[rows], ring_row[rows], is_new[rows], new_row[rows], valid[rows]
        win = L.win_codec.decode(*(p[ring_row] for p in ring), dtype=kv.dtype)
        keys = torch.where(is_new[..., None], kv[new_row], win)
        if self.ratio:
            chosen_rows = self._selected(meta, meta.positions.shape[0], q.device)
            if rows is not None:
                chosen_rows = chosen_rows[rows]
            chosen = L.cmp_codec.decode(*(p[chosen_rows.clamp_min(0)] for p in pools.compressed[self.source]),
                                        dtype=kv.dtype)
            keys, valid = torch.cat([keys, chosen], 1), torch.cat([valid, chosen_rows >= 0], 1)
        # masked slots keep whatever row they point at: every pool row holds a decoded finite value (pools start
        # zeroed and are written only through the codecs), and a -inf bias gives it a weight of exactly 0
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=q.device).masked_fill(~valid, float("-inf"))
        return ops.sink_attention(q, keys, bias, self.w.attn_sink, self.scale)

    def _write_window(self, kv_parts, meta: StepMeta, pools: CachePools) -> None:
        # after the reads: a long chunk's writes may reuse rows it read
        for part, new in zip(pools.window[self.layer], kv_parts):
            part.index_copy_(0, meta.window.write_row, new)

    def _attend_strips(self, q, kv_parts, meta: StepMeta, pools: CachePools, pw: PrefillWindow) -> torch.Tensor:
        """The prefill rows (pw.rows) over their window strips and selected entries, through the decode op: the
        same keys in the same order as their slates, so bitwise the slate path's result on the CPU, without a
        [rows x keys] bf16 slate on the GPU."""
        L = pools.layout
        strips = pw.strips(kv_parts)
        for strip, ring, new in zip(strips, pools.window[self.layer], kv_parts):
            strip.index_copy_(0, pw.hist_dst, ring[pw.hist_src])
            strip.index_copy_(0, pw.new_dst, new if pw.rows is None else new[pw.rows])
        n, width = pw.pos.shape
        codes, scales = (s[: n * width].view(n, width, -1) for s in strips)
        pos = meta.positions if pw.rows is None else meta.positions[pw.rows]
        sel, cmp_kv, cmp_scale = self._pool_keys(meta, pools, q.shape[0], q.device)
        if pw.rows is not None:
            q, sel = q[pw.rows], sel[pw.rows]
        return self.ops.sink_attention_decode(q, pw.seq, pos, codes, scales, pw.pos, cmp_kv, cmp_scale, sel,
                                              self.w.attn_sink, self.scale, L.window)

    def _attend_decode(self, q, kv_parts, meta: StepMeta, pools: CachePools,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """Decoding queries (every query, or the queries `rows`: each sequence's new token, or a verification's
        anchor and drafts): write the step's rows into the ring, then attend over the caches as stored (the decode
        kernel on the GPU; the same slate as the prefill path, so bitwise the same result on the CPU)."""
        L, S, R = pools.layout, pools.slots_alloc, pools.layout.ring
        ring = pools.window[self.layer]
        if kv_parts is not None:  # (None: window_kv wrote the rows)
            self._write_window(kv_parts, meta, pools)
        codes, scales = (p[: S * R].view(S, R, -1) for p in ring)
        slot, pos = meta.tok_slot32, meta.positions32
        sel, cmp_kv, cmp_scale = self._pool_keys(meta, pools, q.shape[0], q.device)
        if rows is not None:
            q, slot, pos, sel = q[rows], slot[rows], pos[rows], sel[rows]
        return self.ops.sink_attention_decode(q, slot, pos, codes, scales, pools.win_pos[: S * R].view(S, R), cmp_kv,
                                              cmp_scale, sel, self.w.attn_sink, self.scale, L.window)
