"""Long JSON-schema enums compile as a trie of rules (deepinfer.sampling.literal_trie): the grammar accepts exactly
the strings and allows exactly the tokens it did as xgrammar's flat alternation, and costs a fraction of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer

from deepinfer.sampling.bitmask import allocate_bitmask, unpack_bitmask
from deepinfer.sampling.grammar import GrammarCompilerPool, tokenizer_info
from deepinfer.sampling.literal_trie import factor_literal_alternations, literal_units

TOKENIZER = Path(__file__).parent / "fixtures/deepseek_v41/tiny-engram-hc4/tokenizer.json"
EMBEDDED_TOKENIZER = Path(__file__).parents[1] / "deepinfer/assets/tiny-v41/tokenizer.json"  # a 1,536 vocabulary
VOCAB, EOS = 512, 1
# prefixes of one another, the escapes xgrammar prints (quote, backslash, tab, control, Latin-1, a BMP
# non-printable, an astral character), the empty string, numbers that extend each other, the JSON constants
ODD = ["a", "ab", "abc", "", 'q"uote', "back\\slash", "t\tab", "\u0001ctl", "é", "x\u2028y", "😀", 1, 12, 12.5,
       None, True, False]
VALUES = ODD + [f"key{i}" for i in range(200)] + [f"kez{i}x" for i in range(20)]


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer.from_file(str(TOKENIZER))
    return tok, xgr.GrammarCompiler(tokenizer_info(tok, VOCAB, [EOS]), cache_enabled=False)


def flat_and_factored(schema: dict):
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=4)
    factored = factor_literal_alternations(str(grammar))
    assert factored is not None
    return grammar, factored


def accepts(compiled, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_an_enum_as_a_trie_accepts_every_value_and_nothing_else(compiler):
    _, comp = compiler
    flat, factored = flat_and_factored({"enum": VALUES})
    flat, factored = comp.compile_grammar(flat), comp.compile_grammar(factored)
    texts = [json.dumps(v, ensure_ascii=False) for v in VALUES]
    others = ([t + "x" for t in texts] + [t[:-1] for t in texts if len(t) > 1] + ['"ke"', '"key"', '"kez1"', "1.2",
              '"abd"', '"b"', "nul", '"key200"'])
    for text in texts:
        assert accepts(flat, text) and accepts(factored, text), text
    for text in others:
        assert accepts(factored, text) == accepts(flat, text), text
    assert accepts(factored, "12") and not accepts(factored, '"key200"')


def test_an_enum_as_a_trie_allows_the_same_tokens_at_every_step(compiler):
    tok, comp = compiler
    schema = {"type": "object", "properties": {"x": {"enum": VALUES}, "y": {"type": "integer"}}, "required": ["x"]}
    flat, factored = (comp.compile_grammar(g) for g in flat_and_factored(schema))
    for text in ['{"x": "key17", "y": 3}', '{"x": "ab"}', '{"x": 12.5}', '{ "x" : "kez3x" }']:
        a, b = xgr.GrammarMatcher(flat), xgr.GrammarMatcher(factored)
        for step, token in enumerate(tok.encode(text, add_special_tokens=False).ids + [None]):
            masks = []
            for matcher in (a, b):
                bits = allocate_bitmask(1, VOCAB)
                matcher.fill_next_token_bitmask(bits, 0)
                masks.append(unpack_bitmask(bits, VOCAB)[0])
            assert torch.equal(*masks), f"{text!r} step {step}"
            if token is not None:
                assert a.accept_token(token) and b.accept_token(token)


def test_a_flood_sized_enum_compiles_to_a_fraction_of_its_flat_size():
    """The soak's grammar flood: 10,000 values sharing a prefix (45.7 MiB flat, 1.0 MiB as a trie)."""
    tok = Tokenizer.from_file(str(EMBEDDED_TOKENIZER))
    comp = xgr.GrammarCompiler(tokenizer_info(tok, tok.get_vocab_size(), [EOS]), cache_enabled=False)
    schema = {"type": "object", "properties": {"x": {"enum": [f"s127.0.0.2k0v{i}" for i in range(10_000)]}}}
    flat, factored = (comp.compile_grammar(g) for g in flat_and_factored(schema))
    assert factored.memory_size_bytes * 10 < flat.memory_size_bytes


def test_short_or_prefix_free_alternations_and_other_rules_are_left_as_they_are():
    small = str(xgr.Grammar.from_json_schema(json.dumps({"enum": ["a", "b", "c"]})))
    assert factor_literal_alternations(small) is None
    unshared = ["".join(chr(0x4E00 + 100 * j + i) for j in range(8)) for i in range(100)]  # no common prefixes
    assert factor_literal_alternations(str(xgr.Grammar.from_json_schema(json.dumps({"enum": unshared})))) is None
    odd = 'root ::= (("a\\q") | ' + " | ".join(f'("v{i}")' for i in range(100)) + ")\n"  # an escape it does not know
    assert factor_literal_alternations(odd) is None
    mixed = "root ::= ((" + " | ".join(f'("v{i}" x)' for i in range(100)) + "))\nx ::= ((\"y\"))\n"
    assert factor_literal_alternations(mixed) is None


def test_the_compiler_pool_compiles_json_enums_as_tries():
    """A heavy schema (the flood's enum): the pool counts its compiled grammar's bytes while it is alive."""
    tok = Tokenizer.from_file(str(EMBEDDED_TOKENIZER))
    vocab = tok.get_vocab_size()
    comp = xgr.GrammarCompiler(tokenizer_info(tok, vocab, [EOS]), cache_enabled=False)
    schema = json.dumps({"type": "object", "properties": {"x": {"enum": [f"s127.0.0.2k0v{i}" for i in range(10_000)]}}})
    flat = comp.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=32)
    with GrammarCompilerPool.for_tokenizer(tok, vocab, EOS) as pool:
        state = pool.compile({"schema_type": "json", "schema": schema})
        assert 0 < pool.live_bytes * 10 < flat.memory_size_bytes
        assert masks_allowed_after(state, tok, vocab, '{"x": "s127.0.0.2k0v9999"}')[EOS]


def masks_allowed_after(state, tok, vocab: int, text: str) -> torch.Tensor:
    for token in tok.encode(text, add_special_tokens=False).ids:
        assert state.accept_token(token)
    bits = allocate_bitmask(1, vocab)
    state.fill_bitmask(bits, 0)
    return unpack_bitmask(bits, vocab)[0]


def test_literal_units_count_each_printed_character_or_escape_and_skip_character_classes():
    assert literal_units('root ::= "ab" | "c"') == 3
    assert literal_units('root ::= "a\\"b" [^"\\\\] "\\x41c" "\\u00e9"') == 6  # \\" one unit; the class's quote none
    assert literal_units("root ::= [a-z]+") == 0


def test_an_enum_that_shares_no_prefix_counts_every_character_and_a_trie_counts_its_prefixes_once():
    unshared = [f"{i * 7919 % 100000:05d}{'abcdefghij'[i % 10]}" for i in range(1000)]
    flat = str(xgr.Grammar.from_json_schema(json.dumps({"enum": [f"id-0000-{i:04d}" for i in range(1000)]})))
    factored = factor_literal_alternations(flat)
    assert literal_units(factored) < literal_units(flat) / 3  # "id-0000-" stored once, not 1,000 times
    plain = str(xgr.Grammar.from_json_schema(json.dumps({"enum": unshared})))
    assert literal_units(plain) >= 1000 * 8  # 6 characters and the two JSON quotes each
