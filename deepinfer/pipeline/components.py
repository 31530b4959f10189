"""The built-in stage components. Each factory receives the loaded model and the sampler, then the stage's
options (pipeline.stages.NAME.options) as keyword arguments (the registry binds them: hydra.utils.instantiate with
_partial_)."""

from __future__ import annotations

from tokenizers import Tokenizer


class TextTokenizer:
    """The tokenize stage: text <-> ids with the checkpoint's tokenizer, and the checks a prompt must pass before
    it may enter the model. encode() adds BOS (the tokenizer's post-processor does)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def validate(self, prompt_ids: list[int], max_model_len: int) -> str | None:
        """None if the prompt can run, else a one-line reason (the request then ends with finish_reason=error)."""
        if not prompt_ids:
            return "empty prompt: at least one token is needed"
        if len(prompt_ids) >= max_model_len:
            return (
                f"prompt has {len(prompt_ids)} tokens; allowed: at most {max_model_len - 1} "
                f"(max_model_len={max_model_len} leaves room for one generated token)"
            )
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"prompt token id {bad!r} is out of range; allowed: [0, {self.vocab_size - 1}]"
        return None


def hf_tokenizer(model, sampler) -> TextTokenizer:
    return TextTokenizer(model.tokenizer, model.config.vocab_size)


def model_forward(model, sampler):
    """The model's own step (deepinfer/models/step.py): the step metadata built on the host, then model.run."""
    from deepinfer.models.step import ModelStep

    return ModelStep(model)


def sampler(model, sampler):
    return sampler


def yoco_mask(model, sampler, keep_tokens: int):
    return _replay(model, "mask", keep_tokens)


def yoco_compact(model, sampler, keep_tokens: int):
    return _replay(model, "compact", keep_tokens)


def _replay(model, mode: str, keep_tokens: int):
    """The replay stage (YOCO bounded replay, deepinfer/models/replay.py); keep_tokens: K."""
    from deepinfer.config.errors import ConfigError
    from deepinfer.models.replay import BoundedReplay

    try:
        return BoundedReplay(model.config, mode, keep_tokens)
    except ValueError as exc:  # a model without YOCO decoder layers: the config asked for what it cannot run
        raise ConfigError(str(exc)) from None
