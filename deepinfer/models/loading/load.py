"""`load_model`: a checkpoint directory or hub id -> a ready DeepseekV41Model (or, without weights, a ModelCard),
with the op set built for the device and the one-line checks an expert-parallel load needs before reading."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from deepinfer.distributed.expert_parallel import ExpertParallel
from deepinfer.kernels.registry import OpSet

from ..card import ModelCard
from ..deepseek_v41 import DeepseekV41Model
from ..vision.loading import checkpoint_vision, load_vision_model
from .checkpoint import read_config, load_checkpoint
from .errors import CheckpointError
from .hub import resolve_model_dir

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from deepinfer.distributed.placement import ExpertPlacement

log = logging.getLogger("deepinfer.loading")


def load_model(
    model: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backends: dict[str, list[str]] | list[str] | None = None,
    strict_backends: bool = False,
    batch_invariant: bool = False,
    weights: bool = True,
    packed_experts: bool | None = None,
    fp8_linears: bool | None = None,
    draft_layers: bool = True,
    load_format: str = "auto",
    tokenizer: str | Path | None = None,
    seed: int = 0,
    expert_placement: ExpertPlacement | None = None,
    ep_rank: int = 0,
    ep_group: ProcessGroup | None = None,
    ep_max_tokens: int = 0,
    ep_agree_group: ProcessGroup | None = None,
    engram_storage: str = "device",
) -> DeepseekV41Model | ModelCard:
    """Load a local Hugging Face directory or hub id into a ready model (with `weights=False`: a checked
    ModelCard, for a frontend whose engine process holds the weights).

    `batch_invariant`: the torch backend is row-invariant by construction (fixed GEMM row tiles, tail-free SIMD,
    per-query key slates, order-free indexer scores); the TileLang backend switches to fixed splits and tiles
    (OpSet.build(batch_invariant=...)).

    `packed_experts` (default: on CUDA) keeps FP4/FP8 expert weights as stored, stacked once (PackedExperts): the
    TileLang grouped GEMM streams them, the torch op dequantises the experts each call touches. The values are
    the same either way; dense dequantised experts would need ~27 GB per layer at V4.1-Flash size.

    `fp8_linears` (default: on CUDA) keeps the other FP8 projections as stored (Fp8BlockWeight, 1 byte per weight
    instead of 2 in bf16): the TileLang linear dequantises tiles in registers, the torch op dequantises per call
    (same values, identical logits on the CPU, where the default stays dense).

    `draft_layers`: load the DSpark draft layers (`mtp.*`) when the checkpoint has them (model.drafter); without
    them the model decodes one token per step and they take no memory.

    `load_format="dummy"` (DeepInfer's, for benchmarking; "dummy_shared": backbone layers of one kind sharing their
    tensors, deepinfer.models.random_weights share_layers): no weight file is read (a directory or hub id with only
    config.json and tokenizer.json is enough); the weights are random in the released storage formats for the
    checkpoint's config (deepinfer.models.random_weights, drawn with `seed`: the same config and seed
    give the same weights, on one device type), the draft layers too when loaded. `tokenizer`: a tokenizer.json
    (or a directory holding one) instead of the checkpoint's; its vocabulary must fit the config.

    `expert_placement` (deepinfer.distributed.placement.ExpertPlacement; issue 13 expert parallelism): this process
    is rank `ep_rank` of `ep_group` (None: the default group, which must be initialised before the first forward).
    Only the routed experts of the rank's physical slots are read from the checkpoint (a replicated expert once);
    shared experts, attention, router, embeddings and Engram tables load in full on every rank. The model runs in
    expert-parallel mode (`model.expert_parallel`, deepinfer.distributed.expert_parallel.ExpertParallel): every rank
    must call `forward` the same number of times. The DSpark draft layers (`draft_layers`) load whole on every
    rank: their routed experts are replicated, so drafting has no collective. One log line gives this rank's
    weight bytes. `ep_max_tokens` > 0 allocates the static-capacity dispatch buffers
    (deepinfer.distributed.ep_dispatch) for forwards of at most that many tokens per rank; every forward then
    starts with the ranks' agreement on the path, on `ep_agree_group` (a gloo group of the same ranks; None:
    ep_group, which must then be gloo). With
    `load_format="dummy"` every expert is drawn (the draws depend on all of them) and the other ranks' are dropped.

    `engram_storage="host"` (model.engram_storage): the Engram tables live in host memory (models/engram_host.py;
    read from the files straight into pinned memory on CUDA, never through the device). With `load_format="dummy"`
    they are drawn on the device first (so a full-size dummy run needs the device memory for them while loading)."""
    if engram_storage not in ("device", "host"):
        raise ValueError(f"engram_storage={engram_storage!r}; allowed: device, host")
    dummy = load_format in ("dummy", "dummy_shared")
    model_dir = resolve_model_dir(model, weights=not dummy)
    local = None
    if expert_placement is not None:
        local = _check_expert_parallel(model_dir, expert_placement, ep_rank, ep_group)
    if packed_experts is None:
        packed_experts = torch.device(device).type == "cuda"
    if fp8_linears is None:
        fp8_linears = torch.device(device).type == "cuda"
    ckpt = load_checkpoint(model_dir, dtype=dtype, device=device, weights=weights, quantized_experts=packed_experts,
                           quantized_linears=fp8_linears, draft_layers=draft_layers, load_format=load_format,
                           tokenizer=tokenizer, routed_experts=local, engram_host=engram_storage == "host")
    ops = OpSet.build(torch.device(device).type, backends, strict=strict_backends, batch_invariant=batch_invariant)
    tok = Tokenizer.from_file(str(ckpt.tokenizer_path))
    vision = checkpoint_vision(model_dir, ckpt.skipped, ckpt.config)
    if not weights:
        return ModelCard(ckpt.config, tok, ops, torch.device(device), Path(model_dir), vision)
    if dummy:
        from ..random_weights import random_weights

        drafts = draft_layers and ckpt.config.num_nextn_predict_layers > 0
        ckpt.weights = random_weights(ckpt.config, device, dtype, seed, packed_experts, fp8_linears,
                                      draft_layers=drafts, share_layers=load_format == "dummy_shared")
        log.warning(
            "model.load_format=%s: the weights are RANDOM (seed %d, %d tensors for %s/config.json%s); no weight "
            "file was read, outputs are meaningless (benchmarking only)", load_format, seed, len(ckpt.weights),
            model_dir, ", with draft layers" if drafts else "")
    if expert_placement is None:
        model = _with_vision(DeepseekV41Model(ckpt.config, ckpt.weights, tok, ops, device, dtype,
                                              free_stored_experts=True), vision, model_dir)
        if engram_storage == "host":
            model.keep_engram_on_host()
        return model
    ep = ExpertParallel(expert_placement, ep_rank, ep_group)
    model = DeepseekV41Model(ckpt.config, ckpt.weights, tok, ops, device, dtype, expert_parallel=ep,
                             free_stored_experts=True)
    if engram_storage == "host":
        model.keep_engram_on_host()
    if ep_max_tokens:
        top_k = max(lw.ffn.top_k or ckpt.config.num_experts_per_tok for lw in model.layers)
        ep.plan_static(ep_max_tokens, top_k, ckpt.config.hidden_size, dtype, device, ep_agree_group)
    _with_vision(model, vision, model_dir)
    del ckpt
    log.info(
        "expert parallel rank %d of %d: %d of %d physical expert slots per layer (%d distinct experts of %d), "
        "weights on this rank %.3f GB (routed experts %.3f GB); static dispatch buffers %.3f GB", ep_rank,
        expert_placement.num_ranks, expert_placement.per_rank, expert_placement.num_physical, len(set(local)),
        expert_placement.num_logical, model.weight_bytes() / 1e9, model.routed_expert_bytes() / 1e9,
        ep.buffers.nbytes / 1e9 if ep.buffers is not None else 0.0)
    return model


def _with_vision(model: DeepseekV41Model, vision, model_dir) -> DeepseekV41Model:
    """The model with its image path (vision.*, aligner.*, image_*) loaded when the checkpoint has one."""
    if vision is None:
        return model
    lacking = [i for i, lw in enumerate(model.layers) if lw.ffn.gate.bias_vl is None]
    if lacking:
        raise CheckpointError(f"{model_dir}: a checkpoint with a vision tower needs layers.N.ffn.gate.bias_vl (image "
                              f"tokens route with it); layers {lacking[:8]} have none")
    # the text model's dtype (bf16 on the GPU), device and OpSet: the ViT's norms and attention go through its kernels
    model.vision = load_vision_model(model_dir, model.dtype).to(model.device).use_ops(model.ops)
    log.info("image path loaded: ViT %d layers of width %d, aligner to %d, at most %d tokens per image",
             vision.num_hidden_layers, vision.hidden_size, vision.text_hidden_size, vision.max_image_tokens)
    return model


def _check_expert_parallel(model_dir, placement, rank: int, group) -> tuple[int, ...]:
    """One-line errors for an expert-parallel load that cannot work; returns the rank's logical experts."""
    import torch.distributed as dist

    cfg = read_config(Path(model_dir))
    if placement.num_logical != cfg.n_routed_experts:
        raise ValueError(f"expert_placement has {placement.num_logical} logical experts; the model has "
                         f"n_routed_experts={cfg.n_routed_experts}")
    if not 0 <= rank < placement.num_ranks:
        raise ValueError(f"ep_rank={rank} is out of range; allowed: 0..{placement.num_ranks - 1}")
    if dist.is_initialized():
        world, me = dist.get_world_size(group), dist.get_rank(group)
        if world != placement.num_ranks or me != rank:
            raise ValueError(f"expert_placement is for {placement.num_ranks} ranks and ep_rank={rank}; this process "
                             f"is rank {me} of a group of {world}")
    return placement.local_logical(rank)
