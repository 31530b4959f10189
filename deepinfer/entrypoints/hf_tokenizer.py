"""DeepInfer's `LLM.get_tokenizer()`: a transformers fast tokenizer over the served `tokenizers.Tokenizer`, so
`tok.encode(text)` is a list of ids (the beginning-of-sequence token included, as generate() encodes prompts),
`tok.decode(ids)` keeps special tokens (DeepInfer's default) and `eos_token_id` is the model's EOS.

transformers is imported here only (lazily): it is a dependency of this drop-in path alone.
"""

from __future__ import annotations


def hf_tokenizer(tokenizer, eos_token_id: int | None):
    """tokenizer: a `tokenizers.Tokenizer`; eos_token_id: the model's end-of-sequence id (None: none)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:  # one line: what is missing and what needs it
        raise ImportError("LLM.get_tokenizer() returns a transformers tokenizer, as DeepInfer's does: install "
                          "transformers (pip install transformers)") from exc
    special = {}
    leading = tokenizer.encode("").ids  # what the post-processor adds to every text: the BOS token
    if leading:
        special["bos_token"] = tokenizer.id_to_token(leading[0])
    if eos_token_id is not None:
        special["eos_token"] = tokenizer.id_to_token(eos_token_id)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
