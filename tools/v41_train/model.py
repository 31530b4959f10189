"""A differentiable, full-sequence DeepSeek-V4.1 text model for training (MODEL_V41_SPEC.md §4).

The same architecture and arithmetic as deepinfer/models/deepseek_v41.py (the inference model), written over a
causal batch [B, T] of sequences that start at position 0 instead of over cache pools:
  - every per-token op (linear, RMSNorm, RoPE, mHC mixes with Sinkhorn / collapse / expand, router, experts,
    Engram hash and gate, compressor pooling, the indexer's selection scores and top-k) is the inference op
    from deepinfer.kernels.torch, called on the flattened tokens;
  - attention over the window + selected compressed entries, and the indexer's differentiable scores and KL
    target, are the dense forms in ops.py;
  - weights go through stored.quantized_weight, so the forward uses the checkpoint's own FP8/FP4/BF16 values, and
    the in-forward activation quantisers (window KV FP8, compressed KV FP4, indexer Q/K FP4) are straight-through.
Only the parameters are held here (canonical checkpoint names, fp32 masters); `export_weights()` hands them to
the embedded writer. The router's selection bias is not a parameter: it follows the aux-loss-free noaux_tc rule
(`update_router_bias`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from tokenizers import Tokenizer
from torch import nn

from deepinfer.kernels.torch.compressor import compressor_pool
from deepinfer.kernels.torch.engram import engram_gate, engram_hash
from deepinfer.kernels.torch.indexer import index_topk, indexer_scores
from deepinfer.kernels.torch.linear import linear
from deepinfer.kernels.torch.mhc import mhc_collapse, mhc_expand, mhc_mixes
from deepinfer.kernels.torch.moe import moe_experts, moe_router
from deepinfer.kernels.torch.norm import rms_norm
from deepinfer.kernels.torch.rope import default_inv_freq, rope, yarn_inv_freq
from deepinfer.models.config import ModelConfig
from deepinfer.models.engram import EngramTables
from deepinfer.models.loading import tensors as kinds

from .ops import entry_visibility, indexer_kl, indexer_scores_dense, sink_attention_dense, window_mask
from .stored import fq_fp4, fq_fp8, ste, storage_kind, stored_values

BIAS = ".ffn.gate.bias"


class Output(NamedTuple):
    logits: torch.Tensor  # [B, T, V] fp32
    indexer_kl: torch.Tensor  # scalar: mean over the index layers
    expert_counts: list[torch.Tensor]  # tokens per routed expert, per layer (for the noaux_tc bias update)
    features: dict[int, torch.Tensor]  # layer -> [B, T, D], for the layers asked for in `features_at`


def _key(name: str) -> str:  # nn.ParameterDict keys may not contain "."
    return name.replace(".", "/")


class StoredParams(nn.Module):
    """fp32 masters of a set of checkpoint tensors (canonical names) whose forward values are what the export
    stores (`weights()`), and the routers' selection biases, which follow the noaux_tc rule instead of gradients.
    `moe_prefixes`: the MoE blocks in forward order (the order of a forward's expert counts)."""

    def __init__(self, cfg: ModelConfig, specs: dict[str, kinds.Spec], seed: int, moe_prefixes: list[str]):
        super().__init__()
        self.cfg, self.specs, self.moe_prefixes = cfg, specs, moe_prefixes
        gen = torch.Generator().manual_seed(seed)
        params, biases = {}, {}
        for name, spec in sorted(specs.items()):
            if name.endswith(BIAS):
                biases[name] = torch.zeros(spec.shape)
            else:
                params[_key(name)] = nn.Parameter(init_value(name, spec.shape, cfg, gen))
        self.params = nn.ParameterDict(params)
        self.quant_groups: dict[tuple, list[str]] = {}
        for name, spec in sorted(specs.items()):
            if not name.endswith(BIAS):
                self.quant_groups.setdefault((storage_kind(name, spec), spec.shape), []).append(name)
        for name, b in biases.items():
            self.register_buffer(_key(name), b)

    def bias(self, prefix: str) -> torch.Tensor:
        return getattr(self, _key(prefix + BIAS[1:]))

    def weights(self) -> dict[str, torch.Tensor]:
        """Canonical name -> the value the exported checkpoint holds (straight-through to the fp32 master).
        Tensors of one storage kind and shape are quantised together (stack, one pass, unbind)."""
        out = {}
        for (kind, _), names in self.quant_groups.items():
            masters = [self.params[_key(n)] for n in names]
            if kind == "f32":
                out.update(zip(names, masters))
                continue
            stacked = torch.stack([m.view(-1, m.shape[-1]) for m in masters])
            values = ste(stacked, stored_values(kind, stacked))
            out.update((n, v.view(m.shape)) for n, v, m in zip(names, values.unbind(0), masters))
        for p in self.moe_prefixes:
            out[p + BIAS[1:]] = self.bias(p)
        return out

    def export_weights(self) -> dict[str, torch.Tensor]:
        """fp32 masters (and router biases) on the CPU, for embedded.release_tensors."""
        return {name: (getattr(self, _key(name)) if name.endswith(BIAS) else self.params[_key(name)])
                .detach().float().cpu().clone() for name in self.specs}

    @torch.no_grad()
    def load_export(self, model_dir) -> None:
        """Masters = an export's dequantised values (deepinfer's loader), so training continues from the exported
        model exactly: its values are on the storage grids already (power-of-two block scales), and re-quantising
        them gives them back unchanged."""
        from deepinfer.models.loading import load_checkpoint

        values = load_checkpoint(model_dir, draft_layers=False).weights
        for name, spec in self.specs.items():
            target = getattr(self, _key(name)) if name.endswith(BIAS) else self.params[_key(name)]
            target.copy_(values[name].float().view(spec.shape))

    @torch.no_grad()
    def update_router_bias(self, counts: list[torch.Tensor], rate: float) -> None:
        """noaux_tc (DeepSeek-V3's auxiliary-loss-free balancing): after each step, raise the selection bias of
        experts that got fewer tokens than the mean and lower it for those that got more, by `rate`."""
        for p, c in zip(self.moe_prefixes, counts):
            c = c.float()
            self.bias(p).add_(rate * torch.sign(c.mean() - c))


def hc_block(cfg: ModelConfig, p: str, streams, prev_pre, W, attend, ffn):
    """deepseek_v41.py::_block for the block of prefix `p`: shifted mHC (each site collapses with the previous
    site's pre-mix); `attend(h)` and `ffn(g)` are the block's attention and MoE."""
    mix = (cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)
    hc_attn = (W[p + "hc_attn_fn"], W[p + "hc_attn_scale"], W[p + "hc_attn_base"])
    hc_ffn = (W[p + "hc_ffn_fn"], W[p + "hc_ffn_scale"], W[p + "hc_ffn_base"])
    a_pre, a_post, a_comb = mhc_mixes(streams, *hc_attn, *mix)
    h = rms_norm(mhc_collapse(streams, prev_pre), W[p + "attn_norm.weight"], cfg.rms_norm_eps)
    streams = mhc_expand(attend(h), streams, a_post, a_comb)
    f_pre, f_post, f_comb = mhc_mixes(streams, *hc_ffn, *mix)
    g = rms_norm(mhc_collapse(streams, a_pre), W[p + "ffn_norm.weight"], cfg.rms_norm_eps)
    streams = mhc_expand(ffn(g), streams, f_post, f_comb)
    return streams, f_pre


def moe_ffn(cfg: ModelConfig, p: str, g, W, n_experts: int, top_k: int, counts: list):
    """deepseek_v41.py::_moe for the block of prefix `p`; appends the tokens per routed expert to `counts`."""
    p += "ffn."
    weights, idx = moe_router(g, W[p + "gate.weight"], W[p + "gate.bias"], top_k, cfg.scoring_func, cfg.gate_temp,
                              cfg.norm_topk_prob, cfg.routed_scaling_factor)
    counts.append(torch.bincount(idx.flatten(), minlength=n_experts))
    experts = [tuple(W[f"{p}experts.{e}.{k}.weight"] for k in ("w1", "w2", "w3")) for e in range(n_experts)]
    shared = tuple(W[f"{p}shared_experts.{k}.weight"] for k in ("w1", "w2", "w3"))
    return moe_experts(g, weights, idx, experts, shared, cfg.swiglu_limit)


class TrainModel(StoredParams):
    def __init__(self, config_json: dict, tokenizer: Tokenizer, seed: int):
        cfg = ModelConfig.from_dict(config_json)
        # the text model's tensors (the DSpark draft layers are draft.DraftModel's); the image-token router bias
        # (optional, unused by text) is not trained
        specs = {n: s for n, s in kinds.expected_tensors(cfg, draft_layers=False).items() if not s.optional}
        super().__init__(cfg, specs, seed, [f"layers.{i}." for i in range(cfg.num_hidden_layers)])
        self.register_buffer("main_freqs", default_inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim), persistent=False)
        y = cfg.yarn
        cf = (yarn_inv_freq(cfg.compress_rope_theta, cfg.qk_rope_head_dim, y.factor,
                            y.original_max_position_embeddings, y.beta_fast, y.beta_slow)
              if y else default_inv_freq(cfg.compress_rope_theta, cfg.qk_rope_head_dim))
        self.register_buffer("compress_freqs", cf, persistent=False)
        self.engram = None
        if cfg.engram_layer_ids:
            tabs = EngramTables.build(cfg, tokenizer)
            self.engram = tabs
            known = torch.tensor(tabs.token_map, dtype=torch.int64)
            token_map = torch.full((max(cfg.vocab_size, len(known)),), tabs.pad_id, dtype=torch.int64)
            token_map[: len(known)] = known
            self.register_buffer("engram_token_map", token_map, persistent=False)
            for f in ("multipliers", "primes", "offsets"):
                self.register_buffer("engram_" + f, getattr(tabs, f), persistent=False)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, features_at: tuple[int, ...] = ()) -> Output:
        """ids [B, T] (each row a sequence from position 0). `features_at`: layers whose attention-input streams
        (the trunk entering the layer, before its Engram and mixes) come back averaged over the hc streams — the
        DSpark context features (MODEL_V41_SPEC.md §6.2), the input the draft layers will be trained on."""
        cfg = self.cfg
        B, T = ids.shape
        W = self.weights()
        pos = torch.arange(T, device=ids.device).repeat(B)
        x = W["embed.weight"][ids.reshape(-1)]
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(B * T, cfg.hc_mult, device=ids.device)
        pre[:, 0] = 1.0  # the first attention site collapses stream 0 (the embedding)
        hash_ids = self._engram_hash(ids) if self.engram is not None else None
        ctx = _Context(B, T, pos, window_mask(T, cfg.sliding_window, ids.device))
        features = {}
        for i in range(cfg.num_hidden_layers):
            if i in features_at:
                features[i] = streams.mean(1).view(B, T, -1)
            if i in cfg.engram_layer_ids:
                streams = self._engram(i, streams, W, hash_ids[:, cfg.engram_layer_ids.index(i)])
            streams, pre = self._block(i, streams, pre, W, ctx)
        y = rms_norm(mhc_collapse(streams, pre), W["norm.weight"], cfg.rms_norm_eps)
        logits = linear(y, W["head.weight"]).float().view(B, T, -1)
        kl = torch.stack(ctx.kl).mean() if ctx.kl else logits.new_zeros(())
        return Output(logits, kl, ctx.counts, features)

    def _block(self, i: int, streams, prev_pre, W, ctx):
        cfg, p = self.cfg, f"layers.{i}."
        return hc_block(cfg, p, streams, prev_pre, W, lambda h: self._attention(i, h, W, ctx),
                        lambda g: moe_ffn(cfg, p, g, W, cfg.n_routed_experts, cfg.num_experts_per_tok, ctx.counts))

    # ---- attention (models/attention.py) -----------------------------------------------------
    def _attention(self, i: int, h, W, ctx):
        cfg, p = self.cfg, f"layers.{i}.attn."
        B, T, H, D, eps = ctx.B, ctx.T, cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        ratio = cfg.compress_ratios[i]
        freqs = self.compress_freqs if ratio else self.main_freqs
        q_res = rms_norm(linear(h, W[p + "wq_a.weight"]), W[p + "q_norm.weight"], eps)
        q = rope(linear(q_res, W[p + "wq_b.weight"]).view(-1, H, D), ctx.pos, freqs).view(B, T, H, D)
        kv = rope(rms_norm(linear(h, W[p + "wkv.weight"]), W[p + "kv_norm.weight"], eps), ctx.pos, freqs)
        keys, mask = fq_fp8(kv).view(B, T, D), ctx.window[None]
        if ratio:
            src = cfg.kv_source_of(i)
            if i in cfg.kv_source_layer_ids:
                ctx.entries[i] = self._compress(i, h, W, ctx)
            entries, ikeys = ctx.entries[src]
            count, visible = entry_visibility(T, ratio, h.device)
            if i in cfg.index_source_layer_ids:
                ctx.selected = (src, self._index(i, h, q_res, ikeys, count, visible, W, ctx))
                with torch.no_grad():  # the KL target: this layer's attention over every visible entry
                    target = torch.einsum("bthd,bgd->bhtg", q, entries) * D**-0.5
                ctx.kl.append(indexer_kl(ctx.scores, target, visible))
            if ctx.selected is not None and ctx.selected[0] == src:
                sel = ctx.selected[1]
            else:  # no index source for this source yet: nothing compressed is selectable
                sel = torch.zeros(B, T, entries.shape[1], dtype=torch.bool, device=h.device)
            keys = torch.cat([keys, entries], 1)
            mask = torch.cat([mask.expand(B, -1, -1), sel], -1)
        out = sink_attention_dense(q, keys, mask, W[p + "attn_sink"], D**-0.5).reshape(B * T, H, D)
        out = rope(out, ctx.pos, freqs, inverse=True)
        grouped = out.reshape(B * T, cfg.o_groups, -1)
        wo_a = W[p + "wo_a.weight"].view(cfg.o_groups, cfg.o_lora_rank, -1)
        y = torch.cat([linear(grouped[:, g], wo_a[g]) for g in range(cfg.o_groups)], dim=-1)
        return linear(y, W[p + "wo_b.weight"])

    def _compress(self, i: int, h, W, ctx):
        """A KV source's compressed entries [B, G, D] (FP4, post-RoPE) and indexer keys [B, G, d] (FP4): ratio 1
        one entry per token, ratio 2 a per-channel softmax-gated pool of tokens {2g, 2g+1}, RoPE at 2g."""
        cfg, p, eps = self.cfg, f"layers.{i}.attn.", self.cfg.rms_norm_eps
        B, T, D, r = ctx.B, ctx.T, cfg.head_dim, cfg.compress_ratios[i]
        if r == 1:
            latent = rms_norm(linear(h, W[p + "compressor.wkv.weight"]), W[p + "compressor.norm.weight"], eps)
            pos = ctx.pos
        else:
            G = T // r
            hv = h.view(B, T, -1)[:, : G * r].reshape(B * G * r, -1).float()
            kv = linear(hv, W[p + "compressor.wkv.weight"].float())
            gate = linear(hv, W[p + "compressor.wgate.weight"].float())
            pooled = compressor_pool(kv, gate, r)  # [B * G, D]; groups never straddle rows (T' = G * r)
            latent = rms_norm(pooled.to(h.dtype), W[p + "compressor.norm.weight"], eps)
            pos = (torch.arange(G, device=h.device) * r).repeat(B)
        G = latent.shape[0] // B
        ikeys = None
        if i in cfg.index_source_layer_ids:  # indexer keys from the pre-RoPE latent; their input is detached
            k = rms_norm(linear(latent.detach(), W[p + "indexer.wk.weight"]), W[p + "indexer.k_norm.weight"], eps)
            ikeys = fq_fp4(rope(k, pos, self.compress_freqs), 32, False).view(B, G, -1)
        entries = fq_fp4(rope(latent, pos, self.compress_freqs), 16, True).view(B, G, D)
        return entries, ikeys

    def _index(self, i: int, h, q_res, ikeys, count, visible, W, ctx):
        """The lightning indexer: selection [B, T, G] bool by the inference ops (exact, order-free scores; top-k
        with the two-level candidate blocks), and differentiable scores (ctx.scores) for the KL. The indexer's
        inputs are detached (DeepSeek-V3.2): its only training signal is the KL."""
        cfg, p = self.cfg, f"layers.{i}.attn.indexer."
        B, T, nh, d = ctx.B, ctx.T, cfg.index_n_heads, cfg.index_head_dim
        iq = linear(q_res.detach(), W[p + "wq_b.weight"]).view(-1, nh, d)
        iq = fq_fp4(rope(iq, ctx.pos, self.compress_freqs), 32, False)
        weights = linear(h.detach(), W[p + "weights_proj.weight"]).float() * nh**-0.5
        ctx.scores = indexer_scores_dense(iq.view(B, T, nh, d), ikeys, weights.view(B, T, nh), d**-0.5)
        with torch.no_grad():
            N, G = B * T, ikeys.shape[1]
            q_seq = torch.arange(B, device=h.device).repeat_interleave(T)
            vis = count.repeat(B)
            if h.is_cuda:  # the same formula; a different summation order can only flip exact ties (training only)
                scores = ctx.scores.detach().reshape(N, G)
            else:  # the inference op itself, so the CPU check against the engine sees the very same selection
                scores = indexer_scores(iq.detach(), ikeys.detach(), q_seq, weights.detach(), d**-0.5, vis)
            scores = scores.masked_fill(torch.arange(G, device=h.device)[None, :] >= vis[:, None], float("-inf"))
            uses_candidates = 0 <= cfg.candidate_source_layer_id < i
            selected, cand = index_topk(
                scores, vis, cfg.index_topk,
                candidates=ctx.candidates if uses_candidates else None,
                candidate_blocks=cfg.candidate_topk_blocks if i == cfg.candidate_source_layer_id else 0,
                candidate_block_size=cfg.candidate_block_size,
            )
            if i == cfg.candidate_source_layer_id:
                ctx.candidates = cand
        return selected.view(B, T, G)

    # ---- engram (models/deepseek_v41.py::_engram_hash, _engram) ------------------------------
    def _engram_hash(self, ids: torch.Tensor) -> torch.Tensor:
        """[B * T, n_engram_layers, cols]: n-grams ending at each token, the pad id past the sequence start."""
        n, pad = self.cfg.engram_max_ngram_size, self.engram.pad_id
        c = self.engram_token_map[ids]
        look = torch.stack([torch.nn.functional.pad(c, (s, 0), value=pad)[:, : c.shape[1]] for s in range(n)], -1)
        return engram_hash(look.reshape(-1, n), self.engram_multipliers, self.engram_primes, self.engram_offsets)

    def _engram(self, i: int, streams, W, ids):
        cfg, p = self.cfg, f"layers.{i}.engram."
        rows = W[p + "embed.weight"][ids].flatten(-2)
        key, value = linear(rows, W[p + "wkv.weight"]).split([cfg.hc_mult * cfg.hidden_size, cfg.hidden_size], -1)
        key = key.float().unflatten(-1, (cfg.hc_mult, cfg.hidden_size))
        weight = W[p + "q_weight"] * W[p + "k_weight"]
        return engram_gate(streams, key, value, weight, cfg.rms_norm_eps)


class _Context:
    """What one forward carries from layer to layer (the inference step's `meta.selected` and `meta.candidates`)."""

    def __init__(self, B, T, pos, window):
        self.B, self.T, self.pos, self.window = B, T, pos, window
        self.entries: dict[int, tuple] = {}
        self.selected = None  # (source layer, [B, T, G] bool) of the most recent index source
        self.candidates = None  # the candidate source's level-1 block mask [B * T, G]
        self.scores = None
        self.kl: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []


def init_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Initial fp32 values (drawn in sorted-name order from one CPU generator, so the same on every device).
    Projections N(0, 1/fan_in); those writing into the residual streams (wo_b, w2) also / sqrt(2 * layers);
    norms, Engram q/k weights and mHC scales 1; mHC fn small, so the first mixes are near their bases: pre = post
    = sigmoid(0)-based, comb near-identity (diagonal base 2); sinks 0."""
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    hc = cfg.hc_mult
    if name == "embed.weight" or name.endswith("engram.embed.weight"):
        return normal(1.0)
    if name == "head.weight":
        return normal(0.5 / math.sqrt(cfg.hidden_size))
    if name.endswith(("norm.weight", "q_weight", "k_weight", "hc_attn_scale", "hc_ffn_scale")):
        return torch.ones(shape)
    if name.endswith(("hc_attn_fn", "hc_ffn_fn")):
        return normal(0.1 / math.sqrt(shape[-1]))
    if name.endswith(("hc_attn_base", "hc_ffn_base")):
        base = torch.zeros(shape)
        base[2 * hc:] = 2.0 * torch.eye(hc).flatten()
        return base
    if name.endswith("attn.attn_sink"):
        return torch.zeros(shape)
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(("wo_b.weight", "w2.weight")):
        std /= math.sqrt(2 * cfg.num_hidden_layers)
    return normal(std)
