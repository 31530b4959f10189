"""The two xgrammar 0.2.9 workarounds: the UTF-8 guard agrees with Python's strict incremental decoder, and
length-capped JSON strings are rewritten into an equivalent control-character-free pattern."""

import codecs
import random

import torch

from deepinfer.sampling.bitmask import allocate_bitmask, unpack_bitmask
from deepinfer.sampling.json_schema_shim import rewrite_length_capped_strings
from deepinfer.sampling.utf8_guard import Utf8Guard


def _valid_prefix(data: bytes) -> bool:
    try:
        codecs.getincrementaldecoder("utf-8")("strict").decode(data, final=False)
        return True
    except UnicodeDecodeError:
        return False


def test_the_guard_allows_a_token_exactly_when_the_bytes_stay_a_valid_utf8_prefix():
    rng = random.Random(0)
    samples = "aé€😀\U0010ffff\x7f"
    vocab = [bytes([b]) for b in range(256)]  # every single byte
    vocab += [s.encode()[i:j] for s in samples for i in range(4) for j in range(i + 1, 5) if s.encode()[i:j]]
    vocab += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4))) for _ in range(300)]
    # an overlong form, a surrogate, a code point above U+10FFFF, an overlong 2-byte form, a special token
    vocab += [b"\xe0\x8b\x96", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b""]
    guard = Utf8Guard(vocab, len(vocab))
    for trial in range(300):
        history = b""
        state = Utf8Guard.START
        for _ in range(rng.randrange(0, 4)):  # walk to a random valid state
            choices = [t for t in range(len(vocab)) if _valid_prefix(history + vocab[t])]
            token = rng.choice(choices)
            history, state = history + vocab[token], guard.advance(state, token)
        mask = allocate_bitmask(1, len(vocab))
        guard.restrict_(mask, 0, state)
        allowed = unpack_bitmask(mask, len(vocab))[0].tolist()
        assert allowed == [_valid_prefix(history + b) for b in vocab], (trial, history)


def test_tokens_beyond_the_known_vocabulary_are_left_to_the_grammar():
    guard = Utf8Guard([b"a", b"\xff"], 40)
    mask = allocate_bitmask(1, 40)
    guard.restrict_(mask, 0, Utf8Guard.START)
    allowed = unpack_bitmask(mask, 40)[0]
    assert allowed[0] and not allowed[1] and allowed[2:].all()


def test_length_capped_strings_become_patterns_everywhere_in_the_schema():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 3},
            "b": {"type": "array", "items": {"type": "string", "minLength": 2}},
            "c": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 5}, {"type": "integer"}]},
            "d": {"type": "string", "maxLength": 4, "pattern": "^x+$"},  # user pattern: left alone
            "e": {"type": "string"},  # no cap: xgrammar's own string rule is correct
            "f": {"enum": [{"type": "string", "maxLength": 1}]},  # data, not a schema
        },
    }
    out = rewrite_length_capped_strings(schema)
    props = out["properties"]
    assert props["a"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{0,3}$'}
    assert props["b"]["items"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{2,}$'}
    assert props["c"]["anyOf"][0] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{1,5}$'}
    assert props["d"] == schema["properties"]["d"]
    assert props["e"] == {"type": "string"}
    assert props["f"] == schema["properties"]["f"]
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 3}  # the caller's schema is not mutated
