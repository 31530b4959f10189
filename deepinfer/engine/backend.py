"""What the engine core needs from the model side, gathered in one object the ModelRunner drives.

One construction path: resolved Settings -> `SettingsBackend(settings)` -> EngineBackend, called by the engine core
in the process that runs the model (in-process, the engine-core process, every data-parallel rank). The frontend
loads config and tokenizer only; the core process gets the settings as data (deepinfer.engine.startup, never a
pickled callable), so no tensor crosses the process boundary.

`backend_from_model` is the lower-level step that path ends with: it wraps a model already built. It stays public
for code that builds a model in memory with no checkpoint to name (the GPU benchmarks' and GPU tests' synthetic
models, deepinfer.models.synthetic); such a backend runs only in-process (engine.process=inproc), through
`LLMEngine(lambda: backend, options)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class EngineBackend:
    # the model: its config (vocab, EOS, context length), its caches' layout and allocation, and model.run(meta,
    # pools) for CUDA-graph capture of decode steps
    model: Any
    prefill: Callable[[Any], Any]  # ForwardBatch -> float32 logits [num_seqs, vocab] (any mix of new tokens)
    decode: Callable[[Any], Any]  # ForwardBatch -> logits, every sequence carrying one new token
    sampler: Any  # deepinfer.sampling.Sampler
    tokenizer: Any = None  # .decode(ids, skip_special_tokens=...): needed only for stop strings
    device: str = "cpu"
    replay: Any = None  # the pipeline's YOCO replay stage (models/replay.py BoundedReplay); None: yoco=off

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.model.config.eos_token_id

    @property
    def max_position_embeddings(self) -> int:
        return self.model.config.max_position_embeddings

    def cache_layout(self, block_size: int, **extra):
        """block_size -> CacheLayout (bytes per slot and per block, no tensors)."""
        return self.model.cache_layout(block_size, **extra)

    def allocate_cache(self, num_slots: int, num_blocks: int, block_size: int, **extra):
        """CachePools for (num_slots, num_blocks, block_size), allocated once."""
        return self.model.allocate_cache(num_slots, num_blocks, block_size, **extra)


def backend_from_model(model, sampler=None, program=None, tokenizer=None, batch_invariant: bool = False) -> EngineBackend:
    """Wraps a model already built and, when given, the pipeline's StepProgram, whose prefill/decode stages,
    sampler and replay stage take precedence over the model's own step (models/step.py ModelStep: the step metadata
    built on the host from a ForwardBatch, then model.run); SettingsBackend passes its program. Without a sampler it
    samples over the config's whole vocabulary (the settings path caps it at the tokenizer's)."""
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
    return EngineBackend(model, prefill, decode, sampler, tokenizer, str(getattr(model, "device", "cpu")),
                         getattr(program, "replay", None))


@dataclass(frozen=True)
class SettingsBackend:
    """The one way the engine core gets its backend: resolved Settings -> the configured StepProgram
    (deepinfer.pipeline.build.load_program: the model, its sampler over the tokenizer's vocabulary, the pipeline's
    stages; DSpark's draft layers only with decoding=dspark) -> EngineBackend, built in the process that calls it.
    The in-process core, the engine-core process (startup.describe sends the settings as data), the data-parallel
    ranks, LLM, the server, tests and benchmarks all build through it."""

    settings: Any

    def __call__(self) -> EngineBackend:
        from deepinfer.pipeline.build import load_program

        program, _settings = load_program(self.settings)
        return backend_from_model(program.model, program=program)


BackendFactory = Callable[[], EngineBackend]
