"""What the engine core needs from the model side, gathered in one object the ModelRunner drives.

The core runs in its own process, so it builds its backend there from a zero-argument factory (`BackendFactory`)
that is a typed description (SettingsBackend, ModelDirBackend: deepinfer.engine.startup sends it
as data, never pickled): loading the model never happens in the frontend, and no tensor crosses the process
boundary. In-process (engine.process=inproc) any zero-argument callable works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class EngineBackend:
    prefill: Callable[[Any], Any]  # ForwardBatch -> float32 logits [num_seqs, vocab] (any mix of new tokens)
    decode: Callable[[Any], Any]  # ForwardBatch -> logits, every sequence carrying one new token
    cache_layout: Callable[[int], Any]  # block_size -> CacheLayout (bytes per slot and per block, no tensors)
    allocate_cache: Callable[[int, int, int], Any]  # (num_slots, num_blocks, block_size) -> CachePools, once
    sampler: Any  # deepinfer.sampling.Sampler
    vocab_size: int
    eos_token_id: int | None
    max_position_embeddings: int
    tokenizer: Any = None  # .decode(ids, skip_special_tokens=...): needed only for stop strings
    device: str = "cpu"
    model: Any = None  # the model itself, for CUDA-graph capture of decode steps (model.run(meta, pools))
    replay: Any = None  # the pipeline's YOCO replay stage (models/replay.py BoundedReplay); None: yoco=off


def backend_from_program(program) -> EngineBackend:
    """The pipeline's StepProgram (deepinfer.pipeline.program): its prefill/decode stages, sampler and model."""
    return backend_from_model(program.model, sampler=program.sample, program=program)


def backend_from_model(model, sampler=None, program=None, tokenizer=None, batch_invariant: bool = False) -> EngineBackend:
    """Wraps a loaded model (deepinfer.models.load_model) and, when given, the pipeline's StepProgram, whose
    prefill/decode stages and sampler take precedence over the model's own step (models/step.py ModelStep: the
    step metadata built on the host from a ForwardBatch, then model.run)."""
    cfg = model.config
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    if sampler is None and program is not None:
        sampler = getattr(program, "sample", None)
    if sampler is None:
        from deepinfer.sampling import Sampler

        sampler = Sampler(cfg.vocab_size, cfg.eos_token_id, tokenizer=tokenizer, batch_invariant=batch_invariant)
    if tokenizer is None:
        tokenizer = getattr(sampler, "tokenizer", None)
    step = None
    if getattr(program, "prefill", None) is None or getattr(program, "decode", None) is None:
        from deepinfer.models.step import ModelStep  # here: importing the engine never loads the model code

        step = ModelStep(model)
    prefill = getattr(program, "prefill", None) or step
    decode = getattr(program, "decode", None) or step
    return EngineBackend(
        prefill=prefill,
        decode=decode,
        cache_layout=model.cache_layout,
        allocate_cache=model.allocate_cache,
        sampler=sampler,
        vocab_size=cfg.vocab_size,
        eos_token_id=cfg.eos_token_id,
        max_position_embeddings=cfg.max_position_embeddings,
        tokenizer=tokenizer,
        device=str(getattr(model, "device", "cpu")),
        model=model,
        replay=getattr(program, "replay", None),
    )


@dataclass(frozen=True)
class SettingsBackend:
    """Factory: builds the configured StepProgram (deepinfer.pipeline.build.load_program) from the
    resolved Settings in the process that calls it."""

    settings: Any

    def __call__(self) -> EngineBackend:
        from deepinfer.pipeline.build import load_program

        program, _settings = load_program(self.settings)
        return backend_from_program(program)


@dataclass(frozen=True)
class ModelDirBackend:
    """Factory: loads a model directory (or hub id) with deepinfer.models.load_model in the process
    that calls it, with the directory's tokenizer.json (if any) for stop strings."""

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    batch_invariant: bool = False
    num_threads: int | None = None  # torch intra-op threads in the engine process (None: torch's default)

    def __call__(self) -> EngineBackend:
        import os

        import torch

        from deepinfer.config.hardware import set_cpu_threads
        from deepinfer.models import load_model

        set_cpu_threads(self.num_threads)
        model = load_model(
            self.model, device=self.device, dtype=getattr(torch, self.dtype), batch_invariant=self.batch_invariant
        )
        tokenizer = getattr(model, "tokenizer", None)
        path = os.path.join(str(self.model), "tokenizer.json")
        if tokenizer is None and os.path.isfile(path):
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(path)
        return backend_from_model(model, tokenizer=tokenizer, batch_invariant=self.batch_invariant)


BackendFactory = Callable[[], EngineBackend]
