"""Sampling: SamplingParams, the Sampler (the engine's sample stage), seeds, stop handling, structured outputs.

xgrammar is imported only by ``deepinfer.sampling.grammar`` / ``grammar_state``, so plain sampling never pays
for it.
"""

from deepinfer.sampling.logprobs import SampleOutput, prompt_logprobs
from deepinfer.sampling.params import SamplingParams
from deepinfer.sampling.sampler import SampleRow, Sampler, VerifyRequest
from deepinfer.sampling.seeds import DrawKind, child_seed, request_seed, seed_for
from deepinfer.sampling.stop import StopChecker

__all__ = [
    "DrawKind",
    "SampleOutput",
    "SampleRow",
    "Sampler",
    "SamplingParams",
    "StopChecker",
    "VerifyRequest",
    "child_seed",
    "prompt_logprobs",
    "request_seed",
    "seed_for",
]
