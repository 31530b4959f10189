"""The DeepSeek-V4.1 text model over packed batches with explicit per-sequence state.

Reads like the architecture (MODEL_V41_SPEC.md §4): embedding → hc streams → per layer [Engram] →
attention site (shifted mHC: collapse with the previous site's pre-mix) → FFN site → final collapse,
norm and head. All arithmetic goes through the op set (`kernels/`), never raw kernel calls.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from deepinfer.kernels.registry import OpSet
from deepinfer.kernels.torch.rope import default_inv_freq, yarn_inv_freq
from deepinfer.distributed.context_parallel import ContextParallel
from deepinfer.distributed.expert_parallel import ExpertParallel, ep_moe_experts

from .attention import Attention
from .batch import ForwardBatch
from .cache import CacheLayout, CachePools, SequenceCache, StandaloneAllocator, StepMeta
from .config import ModelConfig
from .engram import EngramTables
from .vision.span import SPAN_ID_COUNT
from .step import ModelStep
from .weights import Engram, HyperConnection, Layer, MoE, arrange, arrange_drafts, held_bytes

# Compressed Engram id of an image-span position: no table lookup, and look-back stops there (VISION_SPEC.md §6.4)
DEAD = -1

# Without an engine (tests, scripts), `new_state()` takes slots and blocks from pools of this size per rollback.
STANDALONE_SLOTS = 64
STANDALONE_TOKENS = 1 << 13  # per slot: every slot can hold this much context at once


class DeepseekV41Model:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: Tokenizer | None,
        ops: OpSet,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        expert_parallel: ExpertParallel | None = None,
        free_stored_experts: bool = False,
    ):
        self.config = cfg
        self.tokenizer = tokenizer
        self.ops = ops
        self.device = torch.device(device)
        self.dtype = dtype
        # expert parallel (deepinfer.distributed.expert_parallel.ExpertParallel: read its docstring, every rank must
        # call forward in step): the layers hold only this rank's physical expert slots
        self.expert_parallel = expert_parallel
        ep = expert_parallel
        # free_stored_experts: `weights`' stored expert tensors are freed as they are stacked (the caller gives
        # them up; a full-depth synthetic Flash model's two copies would not fit an 80 GB GPU together)
        self.layers, glob = arrange(cfg, weights, dtype, ep.placement.local_logical(ep.rank) if ep else None,
                                    free_stored_experts)
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
            Attention(cfg, i, lw.attn, ops, self.main_freqs, self.compress_freqs) for i, lw in enumerate(self.layers)
        ]
        self.layer_hook = None  # optional callable(i) at each layer boundary (0..n_layers): benchmarks time layers
        self.engram_host = None  # Engram tables in host memory (keep_engram_on_host), else on the device
        self.engram = None
        if cfg.engram_layer_ids:
            if tokenizer is None:
                raise ValueError("Engram layers need the checkpoint's tokenizer.json to build their hash tables")
            self.engram = EngramTables.build(cfg, tokenizer).to(self.device)
            # token id -> compressed id on the device: the hash gathers it per step without a host round trip. Ids
            # past the tokenizer (a head wider than its vocabulary) hash as the pad token instead of reading past
            # the table.
            # The image-span sentinels (ids vocab_size .. vocab_size + 4) map to DEAD: Engram skips them and n-gram
            # look-back stops at them (VISION_SPEC.md §6.4).
            known = torch.tensor(self.engram.token_map, dtype=torch.int64)
            width = max(cfg.vocab_size, len(known))
            token_map = torch.full((width + SPAN_ID_COUNT,), self.engram.pad_id, dtype=torch.int64)
            token_map[: len(known)] = known
            token_map[cfg.vocab_size:cfg.vocab_size + SPAN_ID_COUNT] = DEAD
            self.engram_token_map = token_map.to(self.device)
        self._standalone: dict[tuple[int, bool], StandaloneAllocator] = {}
        # the image path (deepinfer.models.vision.VisionModel), attached by the loader when the checkpoint has one;
        # None: the model serves text and refuses images
        self.vision = None
        # the DSpark draft layers hold every one of their routed experts on every rank, also under expert
        # parallelism (their MoE runs locally, `_moe` with layer None): drafting needs no collective, so a rank
        # drafts whenever it has sequences to draft for, and only the verification step, a backbone forward,
        # joins the other ranks
        drafts = arrange_drafts(cfg, weights, dtype)
        self.drafter = None
        if drafts is not None:
            from .dspark import DSpark

            self.drafter = DSpark(self, drafts)

    def use_ops(self, ops: OpSet) -> None:
        """Run on another op set from now on (e.g. the torch reference, to compare backends on one model)."""
        self.ops = ops
        for attn in self.attn:
            attn.ops = ops
        if self.drafter is not None:
            self.drafter.use_ops(ops)

    def keep_engram_on_host(self) -> None:
        """Move the Engram tables to host memory (pinned and mapped into the device's address space on CUDA, in
        FP8 rows where that is exact; models/engram_host.py): each step's gather reads the rows it picks from
        there, with no host round trip (graph-capturable). The outputs are unchanged. Tables the loader already
        put in host memory (load_model(engram_storage="host")) are taken as they are."""
        from .engram_host import HostEngram, HostTable, to_host_table

        held = [lw.engram for lw in self.layers if lw.engram is not None]
        if not held or self.engram_host is not None:
            return
        pin = self.device.type == "cuda"
        tables = []
        for e in held:
            tables.append(e.embed if isinstance(e.embed, HostTable) else to_host_table(e.embed, pin))
            e.embed = None  # the device copy goes (as each table is moved: one table's transient at a time)
        self.engram_host = HostEngram(tables, self.device)

    # ---- memory ----------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of the weights this process holds (layers, embedding, final norm, head; a tensor shared or viewed
        counts once): what each rank of a parallel layout reports when loaded."""
        return held_bytes([self.layers, self.embed, self.final_norm, self.head])

    def routed_expert_bytes(self) -> int:
        """Bytes of the routed experts this process holds (with expert parallelism: only its physical slots)."""
        return held_bytes([lw.ffn.experts for lw in self.layers])

    # ---- caches ----------------------------------------------------------------------------
    def cache_layout(self, block_size: int = 64, max_rollback: int = 0, drafts: bool = False,
                     checkpoint_lag: int = 0) -> CacheLayout:
        """`drafts`: with the DSpark draft layers' rings (the model must have them: load_model(draft_layers=True)).
        `checkpoint_lag`: prefix caching's (CacheLayout)."""
        if drafts and self.drafter is None:
            raise ValueError("cache_layout(drafts=True): this model was loaded without DSpark draft layers")
        return CacheLayout(self.config, self.dtype, block_size, max_rollback, self.drafter.num_layers if drafts else 0,
                           checkpoint_lag)

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int = 64, max_rollback: int = 0,
                       drafts: bool = False, checkpoint_lag: int = 0) -> CachePools:
        """The pools for `num_slots` sequences and `num_blocks` blocks of context (the engine's runner calls this
        once, sized from the cache budget)."""
        return CachePools(self.cache_layout(block_size, max_rollback, drafts, checkpoint_lag), num_slots, num_blocks,
                          self.device)

    def new_state(self, max_rollback: int = 0, drafts: bool = False) -> SequenceCache:
        """A sequence in standalone pools (no engine): its blocks are taken as it grows, and come back when it is
        freed or garbage-collected."""
        alloc = self._standalone.get((max_rollback, drafts))
        if alloc is None:
            block = 64
            blocks = -(-min(self.config.max_position_embeddings, STANDALONE_TOKENS) // block) * STANDALONE_SLOTS
            alloc = StandaloneAllocator(self.allocate_cache(STANDALONE_SLOTS, blocks, block, max_rollback, drafts))
            self._standalone[(max_rollback, drafts)] = alloc
        return alloc.new()

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, cp: ContextParallel | None = None) -> torch.Tensor:
        """A convenience for scripts and tests: one step from a ForwardBatch (models/step.py ModelStep, the
        engine's prefill/decode stage: the host builds the step's metadata, then `run`). `cp`
        (deepinfer.distributed.context_parallel.ContextParallel): balanced context-parallel prefill; every rank of
        cp.group calls forward in step with the same batch and returns the same logits."""
        return ModelStep(self)(batch, cp)

    __call__ = forward

    def run(self, meta: StepMeta, pools: CachePools, replay=None) -> torch.Tensor:
        """The step on the device: reads the metadata and pools, writes the pools, returns float logits. Nothing
        here reads back from the device or loops over sequences (a decode step can be captured as a graph).
        `replay`: a prefill step's YOCO bounded replay (models/replay.py ReplayStep): at its boundary layer it
        switches the rows and metadata the decoder layers run on."""
        cfg, ops = self.config, self.ops
        x = self._embed(meta)
        if self.expert_parallel is not None:  # the ranks agree on this forward's dispatch path (static or variable)
            self.expert_parallel.begin_forward(x.shape[0])
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        # the first attention site collapses stream 0 (the embedding): a one-hot "previous pre-mix"
        pre = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0
        cp = meta.cp  # context parallel: meta holds this rank's rows; cache writes cover the whole step (cp.full)
        full = meta if cp is None else cp.full
        hash_ids = self._engram_hash(full, pools) if self.engram is not None else None
        if cp is not None and hash_ids is not None:
            hash_ids = hash_ids[cp.own]
        pools.win_pos.index_copy_(0, full.window.write_row, full.positions.to(torch.int32))

        image = self._image_mask(meta)  # None on a step without image spans
        hook = self.layer_hook
        drafter = self.drafter if pools.draft_window else None
        features = []
        for i, (lw, attn) in enumerate(zip(self.layers, self.attn)):
            if hook is not None:
                hook(i)
            if drafter is not None and i in drafter.targets:  # DSpark context: the trunk entering the layer
                features.append(streams.float().mean(1).to(self.dtype))
            if lw.engram is not None:
                j = cfg.engram_layer_ids.index(i)
                streams = self._engram(streams, lw.engram, hash_ids[:, j], image, j)
            if replay is not None and i == replay.boundary:
                streams, pre, meta, hash_ids = replay.enter(self, streams, pre, meta, pools, hash_ids)
                image = self._image_mask(meta)
            streams, pre = self._block(streams, pre, lw, attn, meta, pools, i, image)
        if hook is not None:
            hook(len(self.layers))
        if drafter is not None:
            if cp is not None:
                features = cp.gather(*features)
            at = meta if cp is None else cp.full  # meta: the YOCO consumer view after a replay switched it
            drafter.write_context(features, at.positions, at.window.write_row, pools)

        last = meta.host.base.get("last")
        if cp is not None:  # the logit rows' final hidden state from the rank that computed each of them
            rows = last if last is not None else torch.arange(len(cp.index), device=self.device)
            sel = cp.local_rows(rows)
            y = ops.mhc_collapse_norm(streams[sel], pre[sel], self.final_norm, cfg.rms_norm_eps)
            return ops.linear(cp.pick(y, rows), self.head).float()
        if last is not None:
            streams, pre = streams[last], pre[last]
        y = ops.mhc_collapse_norm(streams, pre, self.final_norm, cfg.rms_norm_eps)
        return ops.linear(y, self.head).float()

    def _embed(self, meta: StepMeta) -> torch.Tensor:
        """The token embeddings; on a step with image spans, each span position's row replaced by its image row
        (START, aligner rows and NEWLINEs, END: VISION_SPEC.md §6.2). Span ids (>= vocab_size) have no table row:
        they look up row 0, which is overwritten."""
        img = meta.images
        if img is None:
            return self.embed[meta.ids].to(self.dtype)
        ids = torch.where(meta.ids < self.config.vocab_size, meta.ids, 0)
        x = self.embed[ids].to(self.dtype)
        return x.index_copy(0, img.index, img.rows.to(self.dtype))

    def _image_mask(self, meta: StepMeta) -> torch.Tensor | None:
        """[T] bool: the rows of `meta` at image-span positions (ids >= vocab_size), or None on a step without
        any: routed with bias_vl, passed through Engram."""
        return None if meta.images is None else meta.ids >= self.config.vocab_size

    def _block(self, streams, prev_pre, lw: Layer, attn: Attention, meta: StepMeta, pools: CachePools,
               layer: int | None = None, image: torch.Tensor | None = None):
        cfg, ops = self.config, self.ops
        mix = (cfg.hc_eps, cfg.hc_sinkhorn_iters, cfg.rms_norm_eps)
        a_pre, a_post, a_comb = ops.mhc_mixes(streams, *_hc(lw.hc_attn), *mix)
        h = self.attn_input(streams, prev_pre, lw)
        streams = ops.mhc_expand(attn(h, meta, pools), streams, a_post, a_comb)
        f_pre, f_post, f_comb = ops.mhc_mixes(streams, *_hc(lw.hc_ffn), *mix)
        g = ops.mhc_collapse_norm(streams, a_pre, lw.ffn_norm, cfg.rms_norm_eps)
        streams = ops.mhc_expand(self._moe(g, lw.ffn, layer, image), streams, f_post, f_comb)
        return streams, f_pre

    def attn_input(self, streams, prev_pre, lw: Layer) -> torch.Tensor:
        """A layer's attention-norm output: the streams collapsed with the previous site's pre-mix, normed."""
        return self.ops.mhc_collapse_norm(streams, prev_pre, lw.attn_norm, self.config.rms_norm_eps)

    def _moe(self, g: torch.Tensor, moe: MoE, layer: int | None = None, image: torch.Tensor | None = None
             ) -> torch.Tensor:
        """`layer`: the backbone layer index (expert parallel with EPLB keeps a placement, dispatch table and
        token counts per layer); None for the draft layers, whose experts every rank holds (never a collective). `image` [T] bool: rows that select their experts with
        `bias_vl` instead of `bias` (image-span positions, VISION_SPEC.md §6.3; the weights stay the scores)."""
        cfg, ops = self.config, self.ops
        bias = moe.gate.bias
        if image is not None:
            bias = torch.where(image[:, None], moe.gate.bias_vl, bias)  # [T, n_experts]
        weights, idx = ops.moe_router(
            g, moe.gate.weight, bias, moe.top_k or cfg.num_experts_per_tok, cfg.scoring_func, cfg.gate_temp,
            cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )
        ep = self.expert_parallel
        if ep is not None and layer is not None:  # moe.experts: this rank's physical slots; a collective
            placement, replicas, load = ep.for_layer(layer)
            return ep_moe_experts(g, weights, idx, moe.experts, moe.shared_experts, cfg.swiglu_limit, placement,
                                  ep.group, load=load, replicas=replicas, experts_op=ops.moe_experts,
                                  buffers=ep.step_buffers)
        return ops.moe_experts(g, weights, idx, moe.experts, moe.shared_experts, cfg.swiglu_limit)

    # ---- engram ----------------------------------------------------------------------------
    def _engram_hash(self, meta: StepMeta, pools: CachePools) -> torch.Tensor:
        """[T, n_engram_layers, n_hash_cols] bucket ids of the n-grams ending at each new token: each token looks
        back over its own sequence (this step's tokens, then the slot's history ring), the pad id past its start."""
        tabs = self.engram
        new = self.engram_token_map[meta.ids]
        (valid, is_new, ring_row, new_row), write_row = meta.ngram
        look = torch.where(is_new, new[new_row], pools.ngram[ring_row])
        # look-back stops at an image span: a DEAD slot and every longer shift read the pad id (text: none is DEAD)
        dead = torch.cummax((look == DEAD) & valid, dim=1).values
        look = torch.where(valid & ~dead, look, tabs.pad_id)
        pools.ngram.index_copy_(0, write_row, new)  # after the read: a long chunk may reuse rows it read
        return self.ops.engram_hash(look, tabs.multipliers, tabs.primes, tabs.offsets)

    def _engram(self, streams: torch.Tensor, engram: Engram, ids: torch.Tensor, image: torch.Tensor | None = None,
                j: int = 0) -> torch.Tensor:
        """`image` [T] bool: image-span rows, which pass through unchanged (VISION_SPEC.md §6.4). `j`: the Engram
        layer's index (its rows are gathered from the host tables when they are in host memory)."""
        cfg, ops = self.config, self.ops
        table_rows = self.engram_host.rows(j, ids) if self.engram_host is not None else engram.embed[ids]
        rows = table_rows.flatten(-2).to(self.dtype)  # [T, cols * engram_head_dim]
        kv = ops.linear(rows, engram.wkv)
        key, value = kv.split([cfg.hc_mult * cfg.hidden_size, cfg.hidden_size], dim=-1)
        key = key.float().unflatten(-1, (cfg.hc_mult, cfg.hidden_size))
        out = ops.engram_gate(streams, key, value, engram.weight, cfg.rms_norm_eps)
        return out if image is None else torch.where(image[:, None, None], streams, out)


def _hc(site: HyperConnection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An mHC site's parameters in the order ops.mhc_mixes takes them."""
    return site.fn, site.scale, site.base
