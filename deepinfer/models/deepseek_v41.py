"""The DeepSeek-V4.1 text model over packed batches with explicit per-sequence state.

Reads like the architecture (MODEL_V41_SPEC.md §4): embedding → hc streams → per layer [Engram] →
attention site (shifted mHC: collapse with the previous site's pre-mix) → FFN site → final collapse,
norm and head. All arithmetic goes through the op set (`kernels/`), never raw kernel calls.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepinfer.kernels.registry import OpSet
from deepinfer.kernels.torch.rope import default_inv_freq, yarn_inv_freq

from .attention import Attention
from .batch import ForwardBatch, PackedBatch, to_device
from .card import ModelCard
from .config import ModelConfig
from .engram import EngramTables
from .state import SequenceState
from .weights import LayerWeights, arrange


class DeepseekV41Model:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: Tokenizer | None,
        ops: OpSet,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = cfg
        self.tokenizer = tokenizer
        self.ops = ops
        self.device = torch.device(device)
        self.dtype = dtype
        self.layers, glob = arrange(cfg, weights, dtype)
        self.embed, self.final_norm, self.head = glob["embed"], glob["norm"], glob["head"]
        rope_dim = cfg.qk_rope_head_dim
        self.main_freqs = default_inv_freq(cfg.rope_theta, rope_dim).to(self.device)
        y = cfg.yarn
        self.compress_freqs = (
            yarn_inv_freq(cfg.compress_rope_theta, rope_dim, y.factor, y.original_max_position_embeddings,
                          y.beta_fast, y.beta_slow)
            if y
            else default_inv_freq(cfg.compress_rope_theta, rope_dim)
        ).to(self.device)
        self.attn = [
            Attention(cfg, i, lw, ops, self.main_freqs, self.compress_freqs) for i, lw in enumerate(self.layers)
        ]
        self.layer_hook = None  # optional callable(i) at each layer boundary (0..n_layers): benchmarks time layers
        self.engram = None
        if cfg.engram_layer_ids:
            if tokenizer is None:
                raise ValueError("Engram layers need the checkpoint's tokenizer.json to build their hash tables")
            self.engram = EngramTables.build(cfg, tokenizer).to(self.device)

    def use_ops(self, ops: OpSet) -> None:
        """Run on another op set from now on (e.g. the torch reference, to compare backends on one model)."""
        self.ops = ops
        for attn in self.attn:
            attn.ops = ops

    # ---- state -----------------------------------------------------------------------------
    def new_state(self, max_rollback: int = 0) -> SequenceState:
        return SequenceState(self.config, self.dtype, self.device, max_rollback)

    def cache_bytes_per_token(self) -> float:
        """Bytes of state that grow with context: compressed KV and indexer keys of each source."""
        c, elt = self.config, torch.finfo(self.dtype).bits // 8
        return sum((c.head_dim + c.index_head_dim) * elt / c.compress_ratios[s] for s in c.kv_source_layer_ids)

    def cache_fixed_bytes(self, max_rollback: int = 0) -> int:
        return self.new_state(max_rollback).nbytes()

    # ---- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        pb = PackedBatch.pack(batch, self.device)
        x = self.embed[pb.ids].to(self.dtype)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        # the first attention site collapses stream 0 (the embedding): a one-hot "previous pre-mix"
        pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0
        hash_ids = self._engram_hash(pb) if self.engram is not None else None

        hook = self.layer_hook
        for i, (lw, attn) in enumerate(zip(self.layers, self.attn)):
            if hook is not None:
                hook(i)
            if lw.e_table is not None:
                streams = self._engram(streams, lw, hash_ids[:, cfg.engram_layer_ids.index(i)])
            streams, pre = self._block(streams, pre, lw, attn, pb)
        if hook is not None:
            hook(len(self.layers))

        for st, n in zip(pb.states, pb.lengths):
            st.num_tokens += n
        if not batch.all_logits:
            last = to_device([s + n - 1 for s, n in zip(pb.starts, pb.lengths)], self.device)
            streams, pre = streams[last], pre[last]
        y = ops.rms_norm(ops.mhc_collapse(streams, pre), self.final_norm, cfg.rms_norm_eps)
        return ops.linear(y, self.head).float()

    __call__ = forward

    def _block(self, streams, prev_pre, lw: LayerWeights, attn: Attention, pb: PackedBatch):
        cfg, ops = self.config, self.ops
        mix = (cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)
        a_pre, a_post, a_comb = ops.mhc_mixes(streams, *lw.hc_attn, *mix)
        h = ops.rms_norm(ops.mhc_collapse(streams, prev_pre), lw.attn_norm, cfg.rms_norm_eps)
        streams = ops.mhc_expand(attn(h, pb), streams, a_post, a_comb)
        f_pre, f_post, f_comb = ops.mhc_mixes(streams, *lw.hc_ffn, *mix)
        g = ops.rms_norm(ops.mhc_collapse(streams, a_pre), lw.ffn_norm, cfg.rms_norm_eps)
        streams = ops.mhc_expand(self._moe(g, lw), streams, f_post, f_comb)
        return streams, f_pre

    def _moe(self, g: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        weights, idx = ops.moe_router(
            g, lw.gate_weight, lw.gate_bias, cfg.num_experts_per_tok, cfg.scoring_func, cfg.gate_temp,
            cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )
        return ops.moe_experts(g, weights, idx, lw.experts, lw.shared_expert, cfg.swiglu_limit)

    # ---- engram ----------------------------------------------------------------------------
    def _engram_hash(self, pb: PackedBatch) -> torch.Tensor:
        """[T, n_engram_layers, n_hash_cols] bucket ids of the n-grams ending at each new token."""
        tabs, n = self.engram, self.config.engram_max_ngram_size
        compressed = [tabs.token_map[t] for t in pb.id_list]
        rows = []
        for i, st in enumerate(pb.states):
            new = compressed[pb.starts[i] : pb.starts[i] + pb.lengths[i]]
            hist = st.ngram_history
            for j, _ in enumerate(new):
                window = (hist + new[: j + 1])[-n:]
                window = window[::-1] + [tabs.pad_id] * (n - len(window))  # look-back 0..n-1; pad past the start
                rows.append(window)
            st.push_ngram(new)
        tokens = to_device(rows, self.device)
        return self.ops.engram_hash(tokens, tabs.multipliers, tabs.primes, tabs.offsets)

    def _engram(self, streams: torch.Tensor, lw: LayerWeights, ids: torch.Tensor) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        rows = lw.e_table[ids].flatten(-2).to(self.dtype)  # [T, cols * engram_head_dim]
        kv = ops.linear(rows, lw.e_wkv)
        key, value = kv.split([cfg.hc_mult * cfg.hidden_size, cfg.hidden_size], dim=-1)
        key = key.float().unflatten(-1, (cfg.hc_mult, cfg.hidden_size))
        return ops.engram_gate(streams, key, value, lw.e_weight, cfg.rms_norm_eps)


def load_model(
    model: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backends: dict[str, list[str]] | list[str] | None = None,
    strict_backends: bool = False,
    batch_invariant: bool = False,
    weights: bool = True,
    packed_experts: bool | None = None,
) -> DeepseekV41Model | ModelCard:
    """Load a local Hugging Face directory or hub id into a ready model (with `weights=False`: a checked
    ModelCard, for a frontend whose engine process holds the weights).

    `batch_invariant` is accepted for every backend; the torch backend is row-invariant by
    construction (fixed GEMM row tiles, tail-free SIMD, per-query key slates), so it needs no separate path,
    and no GPU backend has a faster non-invariant variant yet.

    `packed_experts` (default: on CUDA) keeps FP4/FP8 expert weights as stored, stacked once (PackedExperts): the
    TileLang grouped GEMM streams them, the torch op dequantises the experts each call touches. The values are
    the same either way; dense dequantised experts would need ~27 GB per layer at V4.1-Flash size."""
    from .loading import load_checkpoint, resolve_model_dir

    model_dir = resolve_model_dir(model)
    if packed_experts is None:
        packed_experts = torch.device(device).type == "cuda"
    ckpt = load_checkpoint(model_dir, dtype=dtype, device=device, weights=weights, quantized_experts=packed_experts)
    ops = OpSet.build(torch.device(device).type, backends, strict=strict_backends)
    tokenizer = Tokenizer.from_file(str(ckpt.tokenizer_path))
    if not weights:
        return ModelCard(ckpt.config, tokenizer, ops, torch.device(device), Path(model_dir))
    return DeepseekV41Model(ckpt.config, ckpt.weights, tokenizer, ops, device, dtype)
