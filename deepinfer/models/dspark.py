"""DSpark, the checkpoint's draft layers (MODEL_V41_SPEC.md §6): speculative drafting of a block of tokens.

Two halves, both on the model's op set:
  - context (§6.2), inside every main-model forward: the attention-input streams of the target layers, averaged
    over the hc streams, concatenated, projected and normed into one context hidden per token; each draft layer
    projects it to a key (its own wkv, kv_norm, main RoPE, FP8) written into that layer's ring at the token's slot.
  - drafting (§6.3), after a token is sampled: the block [golden, noise, ...] at the positions after the last
    accepted one runs the draft layers (HC attention + HC MoE blocks whose attention sees the W context keys up to
    the last accepted position plus every key of the block, non-causally), then the shared head gives base logits
    per block position, and a first-order Markov head plus a confidence head are applied position by position as
    the drafts are chosen (the Markov bias of position i needs the token chosen at i - 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.kernels.torch.cache_formats import Fp8Codec

from .cache import CachePools
from .weights import Attention as AttentionWeights, DraftWeights


@dataclass
class DraftStep:
    """Where a block's keys come from: per request its slot and the last accepted position a."""

    positions: torch.Tensor  # [N * B] block positions a + 1 + i
    ctx_rows: torch.Tensor  # [N, W] ring rows of positions a - W + 1 .. a
    ctx_valid: torch.Tensor  # [N, W] the position exists (>= 0)
    n: int
    block: int
    bias: torch.Tensor  # [N * B, W + B] every block query's attention bias (-inf: no such position), all layers'


@dataclass
class Drafts:
    tokens: torch.Tensor  # [N, B] int64: draft i is the guess for position a + 2 + i
    confidences: torch.Tensor  # [N, B] float32: predicted acceptance of each draft given the previous ones


class DraftAttention:
    """A ratio-0 V4.1 attention whose block queries see the context ring plus the whole block (non-causal)."""

    def __init__(self, cfg, index: int, w: AttentionWeights, ops, rope_freqs: torch.Tensor):
        self.cfg, self.index, self.w, self.ops, self.freqs = cfg, index, w, ops, rope_freqs
        self.scale = cfg.head_dim**-0.5

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The key of hidden x at `positions` before the cache's quantisation."""
        ops, w, eps = self.ops, self.w, self.cfg.rms_norm_eps
        return ops.rope(ops.rms_norm(ops.linear(x, w.wkv), w.kv_norm, eps), positions, self.freqs)

    def key(self, x: torch.Tensor, positions: torch.Tensor, codec) -> tuple[torch.Tensor, ...]:
        """The stored (FP8) key of hidden x at `positions`: the context keys and the block's own keys alike."""
        return codec.encode(self.kv(x, positions))

    def __call__(self, h: torch.Tensor, step: DraftStep, pools: CachePools) -> torch.Tensor:
        cfg, w, ops = self.cfg, self.w, self.ops
        T, N, B = h.shape[0], step.n, step.block
        codec = pools.layout.win_codec
        q_res = ops.rms_norm(ops.linear(h, w.wq_a), w.q_norm, cfg.rms_norm_eps)
        q = ops.rope(ops.linear(q_res, w.wq_b).view(T, cfg.num_attention_heads, cfg.head_dim), step.positions,
                     self.freqs, inplace=True)
        if isinstance(codec, Fp8Codec):  # decode(encode(kv)) is the fake-quantised kv: one op
            block = ops.fake_quant_fp8(self.kv(h, step.positions), Fp8Codec.block).to(h.dtype).view(N, B, -1)
        else:
            block = codec.decode(*self.key(h, step.positions, codec), dtype=h.dtype).view(N, B, -1)
        ring = pools.draft_window[self.index]
        ctx = codec.decode(*(p[step.ctx_rows] for p in ring), dtype=h.dtype)  # [N, W, D]
        keys = torch.cat([ctx, block], 1)  # every block query sees the same slate
        keys = keys.repeat_interleave(B, 0)
        out = ops.sink_attention(q, keys, step.bias, w.attn_sink, self.scale)
        out = ops.rope(out, step.positions, self.freqs, inverse=True, inplace=True)
        grouped = out.reshape(T, cfg.o_groups, -1)
        y = ops.grouped_linear(grouped, w.wo_a)
        return ops.linear(y, w.wo_b)


class DSpark:
    def __init__(self, model, weights: DraftWeights):
        self.model = model
        self.cfg = model.config
        self.w = weights
        self.targets = tuple(self.cfg.dspark_target_layer_ids)
        self.attn = [DraftAttention(self.cfg, i, lw.attn, model.ops, model.main_freqs)
                     for i, lw in enumerate(weights.layers)]
        self.confidence_temperature: tuple[float, ...] = (1.0,)

    @property
    def num_layers(self) -> int:
        return len(self.w.layers)

    def use_ops(self, ops) -> None:
        for a in self.attn:
            a.ops = ops

    # ---- context: inside the main forward --------------------------------------------------------------------
    def write_context(self, features: list[torch.Tensor], positions: torch.Tensor, write_row: torch.Tensor,
                      pools: CachePools) -> None:
        """features: per target layer [T, D] (the trunk streams entering it, averaged over hc); written into every
        draft layer's ring at the rows the backbone's window writes use (trash for tokens that write no row)."""
        ops, cfg = self.model.ops, self.cfg
        x = ops.linear(torch.cat(features, -1), self.w.main_proj)
        x = ops.rms_norm(x, self.w.main_norm, cfg.rms_norm_eps)
        codec = pools.layout.win_codec
        for attn, ring in zip(self.attn, pools.draft_window):
            if isinstance(codec, Fp8Codec):  # attn.key's norm, rope and FP8 encode and the ring writes as one op
                # (one launch on the GPU where torch's encode took ~20 a layer, every DSpark step)
                ops.window_kv(ops.linear(x, attn.w.wkv), attn.w.kv_norm, cfg.rms_norm_eps, positions, attn.freqs,
                              *ring, write_row)
                continue
            for part, new in zip(ring, attn.key(x, positions, codec)):
                part.index_copy_(0, write_row, new)

    # ---- drafting: after a token is sampled ----------------------------------------------------------------------
    def step(self, slots: torch.Tensor, last: torch.Tensor, block: int, pools: CachePools) -> DraftStep:
        """Block layout for requests in `slots` whose last accepted position is `last` (the golden token sits at
        last + 1)."""
        L = pools.layout
        W, R, dev = L.window, L.ring, slots.device
        look = last[:, None] - (W - 1) + torch.arange(W, device=dev)[None, :]
        rows = slots[:, None] * R + torch.remainder(look, R)
        positions = (last[:, None] + 1 + torch.arange(block, device=dev)[None, :]).reshape(-1)
        valid = look >= 0
        # the block's own keys always exist; made once a step, not by each draft layer
        seen = torch.cat([valid, torch.ones(valid.shape[0], block, dtype=torch.bool, device=dev)], 1)
        bias = torch.zeros(seen.shape, dtype=torch.float32, device=dev).masked_fill(~seen, float("-inf"))
        return DraftStep(positions, rows, valid, slots.shape[0], block, bias.repeat_interleave(block, 0))

    @torch.inference_mode()
    def draft(self, golden: torch.Tensor, step: DraftStep, pools: CachePools,
              choose: Callable[[int, torch.Tensor], torch.Tensor]) -> Drafts:
        """golden [N]: the token just sampled per request. `choose(i, logits [N, V] float32)` picks the drafts of
        block position i (the request's sampling rule) and returns them [N] int64."""
        model, cfg, ops, w = self.model, self.cfg, self.model.ops, self.w
        N, B = step.n, step.block
        tokens = torch.full((N, B), cfg.dspark_noise_token_id, dtype=torch.int64, device=golden.device)
        tokens[:, 0] = golden
        x = model.embed[tokens.reshape(-1)].to(model.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0
        for lw, attn in zip(w.layers, self.attn):
            streams, pre = model._block(streams, pre, lw, attn, step, pools)
        h_pre = ops.mhc_collapse(streams, pre)  # the pre-norm hidden the confidence head reads
        base = ops.linear(ops.rms_norm(h_pre, w.norm, cfg.rms_norm_eps), model.head).float().view(N, B, -1)
        h_pre = h_pre.float().view(N, B, -1)

        drafts = torch.empty(N, B, dtype=torch.int64, device=golden.device)
        conf = torch.empty(N, B, dtype=torch.float32, device=golden.device)
        prev = golden
        temps = self.confidence_temperature
        for i in range(B):
            logits = base[:, i]
            feats = h_pre[:, i]
            if w.markov_embed is not None:
                e = w.markov_embed[prev]
                # the bias in fp32 (§6.3) from the tables as stored: an fp32 copy of the [V, rank] head read twice
                # the bytes (132 MB at Flash's vocabulary, read at every block position)
                logits = logits + ops.linear(e, w.markov_head, out_dtype=torch.float32)
                feats = torch.cat([feats, e.float()], -1)
            # a per-row product-sum (a GEMV's reduction order may follow the batch size), one position at a time:
            # confidences, and so the varlen plan, do not depend on what else is drafted in the step (all
            # positions' sums in one [N * B, D] reduction took another order on the CPU from 25 rows to 40, the
            # graph bucket's padding)
            conf[:, i] = torch.sigmoid((feats * w.confidence).sum(-1) / temps[min(i, len(temps) - 1)])
            prev = choose(i, logits)
            drafts[:, i] = prev
        return Drafts(drafts, conf)
