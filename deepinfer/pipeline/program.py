"""StepProgram: the ordered stages a configured pipeline resolved to, as plain callables for the runner.

The engine reads the named attributes (tokenize, prefill, replay, decode, sample); `stages` keeps the declared
order and what backs each stage for the run summary. A stage the config disables is absent (replay is None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class StageInfo:
    name: str  # tokenize | prefill | replay | decode | sample
    component: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepProgram:
    stages: tuple[StageInfo, ...]
    tokenize: Any  # encode(text) -> ids, decode(ids) -> str, validate(ids, max_model_len) -> error | None
    prefill: Callable  # ForwardBatch -> float32 logits [num_seqs, vocab]
    decode: Callable  # ForwardBatch -> float32 logits [num_seqs, vocab]
    sample: Any  # deepinfer.sampling.Sampler
    model: Any  # new_state(), config, ops
    replay: Callable | None = None  # YOCO bounded replay; None unless a yoco mode enables it

    def new_state(self):
        return self.model.new_state()

    def summary(self) -> dict:
        """stage -> component, op kind -> backend ("(fallback)" marked), and why each fallback happened."""
        ops = getattr(self.model, "ops", None)
        return {
            "stages": {s.name: s.component for s in self.stages},
            "ops": dict(ops.summary()) if ops is not None else {},
            "fallbacks": dict(getattr(ops, "fallbacks", {}) or {}),
        }
