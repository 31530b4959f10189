"""V4.1 attention for one layer over a packed batch: low-rank Q, one shared K = V latent over a
sliding window, and on compressed layers the shared compressed KV chosen by the lightning indexer.

Every query attends to a fixed-width key slate: `window` slots (positions p-W+1 .. p, oldest first)
followed by `index_topk` slots for selected compressed entries (ascending entry order), unused
slots masked. The slate depends only on the query's own position, so a row's result does not
depend on what it is batched with or how its prompt was chunked.
"""

from __future__ import annotations

import torch

from .batch import PackedBatch, to_device
from .weights import LayerWeights


class Attention:
    def __init__(self, cfg, layer: int, w: LayerWeights, ops, rope_freqs: torch.Tensor, compress_freqs: torch.Tensor):
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
    def __call__(self, h: torch.Tensor, pb: PackedBatch) -> torch.Tensor:
        cfg, w, ops = self.cfg, self.w, self.ops
        T = h.shape[0]
        q_res = ops.rms_norm(ops.linear(h, w.wq_a), w.q_norm, cfg.rms_norm_eps)
        q = ops.linear(q_res, w.wq_b).view(T, cfg.num_attention_heads, cfg.head_dim)
        q = ops.rope(q, pb.positions, self.freqs)
        kv = ops.rms_norm(ops.linear(h, w.wkv), w.kv_norm, cfg.rms_norm_eps)
        kv = ops.fake_quant_fp8(ops.rope(kv, pb.positions, self.freqs), 32)

        if self.ratio:
            if self.is_source:
                self._compress(h, pb)
            if self.is_index:
                self._index(h, q_res, pb)
        out = self._attend(q, kv, pb)
        out = ops.rope(out, pb.positions, self.freqs, inverse=True)
        # grouped low-rank output projection: group g holds heads [g*H/G, (g+1)*H/G)
        grouped = out.reshape(T, cfg.o_groups, -1)
        y = torch.cat([ops.linear(grouped[:, g], w.wo_a[g]) for g in range(cfg.o_groups)], dim=-1)
        return ops.linear(y, w.wo_b)

    # ---------------------------------------------------------------------------------------
    def _compress(self, h: torch.Tensor, pb: PackedBatch) -> None:
        """Close the compression groups completed by this step's tokens and publish their entries. The groups
        of every sequence go through the norm, rope and quantizers together (all row-wise ops)."""
        cfg, w, ops = self.cfg, self.w, self.ops
        srcs = [st.sources[self.layer] for st in pb.states]
        if self.ratio == 1:  # every token closes its own group
            latent = ops.rms_norm(ops.linear(h, w.c_wkv), w.c_norm, cfg.rms_norm_eps)
            counts = pb.lengths
            pos = pb.positions
        else:
            kv_all = ops.linear(h.float(), w.c_wkv.float())
            gate_all = ops.linear(h.float(), w.c_wgate.float())
            kvs, gates, counts, firsts = [], [], [], []
            for i, src in enumerate(srcs):
                rows = pb.rows(i)
                kv_new, gate_new = kv_all[rows], gate_all[rows]
                open_rows = pb.past[i] - src.entries * self.ratio  # rows of the group still open before this step
                kv = torch.cat([src.raw_kv.rows[src.raw_kv.rows.shape[0] - open_rows :], kv_new])
                gate = torch.cat([src.raw_gate.rows[src.raw_gate.rows.shape[0] - open_rows :], gate_new])
                src.raw_kv.extend(kv_new)
                src.raw_gate.extend(gate_new)
                n = kv.shape[0] // self.ratio
                kvs.append(kv[: n * self.ratio])
                gates.append(gate[: n * self.ratio])
                counts.append(n)
                firsts.append(src.entries)
            if not any(counts):
                return
            pooled = ops.compressor_pool(torch.cat(kvs), torch.cat(gates), self.ratio)
            latent = ops.rms_norm(pooled.to(h.dtype), w.c_norm, cfg.rms_norm_eps)
            # a group's rope position is the position of its first token
            pos = to_device([(f + j) * self.ratio for f, n in zip(firsts, counts) for j in range(n)], h.device)
        keys = None
        if self.is_index:  # indexer keys come from the pre-RoPE latent
            k = ops.rms_norm(ops.linear(latent, w.i_wk), w.i_k_norm, cfg.rms_norm_eps)
            keys = ops.fake_quant_fp4(ops.rope(k, pos, self.compress_freqs), 32, False).split(counts)
        entries = ops.fake_quant_fp4(ops.rope(latent, pos, self.compress_freqs), 16, True).split(counts)
        for i, src in enumerate(srcs):
            if keys is not None:
                src.index_keys.append(keys[i])
            src.compressed.append(entries[i])

    def _index(self, h: torch.Tensor, q_res: torch.Tensor, pb: PackedBatch) -> None:
        """Score queries against the source's indexer keys; publish each row's selected entries."""
        cfg, w, ops = self.cfg, self.w, self.ops
        T = h.shape[0]
        iq = ops.linear(q_res, w.i_wq_b).view(T, cfg.index_n_heads, cfg.index_head_dim)
        iq = ops.fake_quant_fp4(ops.rope(iq, pb.positions, self.compress_freqs), 32, False)
        weights = ops.linear(h, w.i_weights_proj).float() * cfg.index_n_heads**-0.5
        selections, candidates = [], []
        prev_candidates = pb.scratch.get("candidates") if self.uses_candidates else None
        for i, st in enumerate(pb.states):
            rows = pb.rows(i)
            keys = st.sources[self.source].index_keys.view()
            visible = (pb.positions[rows] + 1) // self.ratio
            scores = ops.indexer_scores(iq[rows], keys, weights[rows], cfg.index_head_dim**-0.5)
            selected, cand = ops.index_topk(
                scores,
                visible,
                cfg.index_topk,
                candidates=None if prev_candidates is None else prev_candidates[i],
                candidate_blocks=cfg.candidate_topk_blocks if self.is_candidate_source else 0,
                candidate_block_size=cfg.candidate_block_size,
            )
            selections.append(selected)
            candidates.append(cand)
        pb.scratch["selected"] = (self.source, selections)
        if self.is_candidate_source:
            pb.scratch["candidates"] = candidates

    # ---------------------------------------------------------------------------------------
    def _attend(self, q: torch.Tensor, kv: torch.Tensor, pb: PackedBatch) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        W, D = cfg.sliding_window, cfg.head_dim
        dev = q.device
        selected = pb.scratch.get("selected")
        use_compressed = self.ratio > 0
        # One bank of key rows for the whole step: per sequence its window ring + this step's KV rows, then
        # (compressed layers) its source's compressed entries. Slates index into it.
        banks, win_shift, comp_start, masks = [], [], [], []
        offset = 0
        for i, st in enumerate(pb.states):
            ring = st.window[self.layer]
            new = kv[pb.rows(i)]
            banks += [ring.rows, new]
            win_shift.append(offset - (pb.past[i] - ring.rows.shape[0]))  # bank row of position p: p + shift
            offset += ring.rows.shape[0] + new.shape[0]
            ring.extend(new)
            if use_compressed:
                entries = st.sources[self.source].compressed.view()
                banks.append(entries)
                comp_start.append(offset)
                offset += entries.shape[0]
                chosen = selected is not None and selected[0] == self.source
                # without an index source for this source in this step, nothing is selectable
                masks.append(selected[1][i] if chosen else torch.zeros(new.shape[0], entries.shape[0], dtype=torch.bool, device=dev))
        bank = torch.cat(banks + [kv.new_zeros(1, D)])  # last row: target of masked slots
        lengths = to_device(pb.lengths, dev)
        win_pos = pb.positions[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :]
        shift = to_device(win_shift, dev).repeat_interleave(lengths, output_size=len(pb.ids))[:, None]
        idx = torch.where(win_pos >= 0, win_pos + shift, -1)
        if use_compressed:
            slots = cfg.index_topk
            width = max(slots, max(m.shape[1] for m in masks))
            mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
            # selected entries first, in ascending entry order; unused slots stay masked
            order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[:, :slots]
            ok = mask.gather(1, order)
            start = to_device(comp_start, dev).repeat_interleave(lengths, output_size=len(pb.ids))[:, None]
            idx = torch.cat([idx, torch.where(ok, order + start, -1)], dim=1)
        valid = idx >= 0
        keys = bank[torch.where(valid, idx, bank.shape[0] - 1)]  # [T, slots, D]
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=dev).masked_fill(~valid, float("-inf"))
        return ops.sink_attention(q, keys, bias, self.w.attn_sink, self.scale)
