"""DeepInfer's `deepinfer.sampling_params.SamplingParams`, as a drop-in: its argument order and defaults, the
same object as deepinfer.SamplingParams underneath (every check and field of ours still applies).

Differences kept on purpose, each where DeepInfer's own engine does something else than the field says:
  logprobs      DeepInfer ignores it (default False). Here False means no per-token logprobs are reported unless
                top_logprobs > 0; with the drop-in LLM's default decode_sequence=True only strings come back anyway.
  eos_id        DeepInfer declares 0 and its engine overwrites it with the tokenizer's EOS; the default None here
                is that model EOS. An explicit id is honoured.
  seq_seed      None: a fresh random seed per request, drawn where the engine admits it (DeepInfer draws it here).
                An integer is masked to 64 bits, as DeepInfer does (a negative `hash(...)` is a valid seed there).
"""

from __future__ import annotations

from deepinfer.sampling.params import SamplingParams as _Params

__all__ = ["SamplingParams"]

SEED_MASK = (1 << 64) - 1


class SamplingParams(_Params):
    def __init__(
        self,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        ignore_eos: bool = False,
        max_tokens: int = 16,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
        top_logprobs: int = 0,
        first_n_token_no_eos: int = 0,
        eos_id: int | None = None,
        so_args: dict | None = None,
        golden_token_ids: list[int] | None = None,
        seq_seed: int | None = None,
        **ours,  # deepinfer.SamplingParams' other fields (stop, min_p, penalties, n, ...), by keyword
    ) -> None:
        if type(seq_seed) is int:
            seq_seed &= SEED_MASK
        super().__init__(temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos,
                         max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                         top_logprobs=top_logprobs, first_n_token_no_eos=first_n_token_no_eos, eos_id=eos_id,
                         so_args=so_args, golden_token_ids=golden_token_ids, seq_seed=seq_seed, **ours)
