"""Structured outputs with xgrammar, driven by random logits: whatever the model prefers, every finished output
matches its grammar. Also: per-request compile errors, timeouts, trigger / bound tokens, rollback."""

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from deepinfer.sampling import SampleRow, Sampler, SamplingParams, StopChecker
from deepinfer.sampling.bitmask import allocate_bitmask, unpack_bitmask
from deepinfer.sampling.grammar import GrammarCompilerPool, GrammarError, tokenizer_info

TOKENIZER = Path(__file__).parent / "fixtures/deepseek_v41/tiny-engram-hc4/tokenizer.json"
VOCAB, EOS = 512, 1


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def pool(tok):
    with GrammarCompilerPool.for_tokenizer(tok, VOCAB, EOS) as p:
        yield p


def single(tok, text):
    (token,) = tok.encode(text, add_special_tokens=False).ids
    return token


def allowed(state, vocab=VOCAB):
    mask = allocate_bitmask(1, vocab)
    state.fill_bitmask(mask, 0)
    return unpack_bitmask(mask, vocab)[0]


def generate(tok, states, params_list, seed=0, max_steps=3000):
    """Samples all requests together with random logits until each finishes; returns their StopCheckers."""
    sampler = Sampler(VOCAB, EOS, tokenizer=tok)
    g = torch.Generator().manual_seed(seed)
    checkers = [StopChecker(p, tok, EOS) for p in params_list]
    live = list(range(len(states)))
    for _ in range(max_steps):
        if not live:
            return checkers
        rows = [
            SampleRow(params_list[i], 1000 + i, len(checkers[i].token_ids), list(checkers[i].token_ids), [], states[i])
            for i in live
        ]
        outs = sampler.sample(torch.randn(len(rows), VOCAB, generator=g) * 2, rows)
        for i, out in zip(list(live), outs):
            assert out.error is None, out.error
            if checkers[i].append(out.token_id, states[i] is not None and states[i].is_terminated()):
                live.remove(i)
    raise AssertionError("generation did not finish")


def schema(i):
    """20 distinct object schemas with required string / integer / enum / array fields, all bounded."""
    props = {
        "name": {"type": "string", "maxLength": 3 + i % 5},
        "count": {"type": "integer", "minimum": -5 * i, "maximum": 100 + i},
        "color": {"enum": ["red", "green", "blue", f"c{i}"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 1 + i % 3},
    }
    if i % 2:
        props["flags"] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
    if i % 4 == 3:
        props["inner"] = {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "id": {"type": "string", "maxLength": 2}},
            "required": ["ok", "id"],
        }
    keys = sorted(props)
    order = keys[i % len(keys) :] + keys[: i % len(keys)]  # field order varies with i
    return {"type": "object", "properties": {k: props[k] for k in order}, "required": order}


def test_twenty_json_schema_requests_all_parse_and_validate(tok, pool):
    schemas = [schema(i) for i in range(20)]
    as_text = [json.dumps(s) if i % 2 else s for i, s in enumerate(schemas)]  # str and dict schemas both work
    states = [pool.compile({"schema_type": "json", "schema": s}) for s in as_text]
    params = [SamplingParams(max_tokens=3000, seq_seed=i, top_p=0.95) for i in range(20)]
    for i, checker in enumerate(generate(tok, states, params)):
        assert checker.finish_reason == "stop" and checker.token_ids[-1] == EOS
        jsonschema.validate(json.loads(checker.text), schemas[i])


def test_regex_output_fully_matches(tok, pool):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)"
    states = [pool.compile({"schema_type": "regex", "schema": pattern}) for _ in range(5)]
    for checker in generate(tok, states, [SamplingParams(max_tokens=200, seq_seed=i) for i in range(5)], seed=1):
        assert checker.finish_reason == "stop"
        assert re.fullmatch(pattern, checker.text), checker.text


def test_ebnf_output_fully_matches(tok, pool):
    grammar = 'root ::= "SELECT " col (", " col){0,3} " FROM " col\ncol ::= [a-z] [a-z0-9_]{0,5}'
    equivalent = r"SELECT [a-z][a-z0-9_]{0,5}(, [a-z][a-z0-9_]{0,5}){0,3} FROM [a-z][a-z0-9_]{0,5}"
    states = [pool.compile({"schema_type": "ebnf", "schema": grammar}) for _ in range(5)]
    for checker in generate(tok, states, [SamplingParams(max_tokens=200, seq_seed=i) for i in range(5)], seed=2):
        assert checker.finish_reason == "stop"
        assert re.fullmatch(equivalent, checker.text), checker.text


def test_a_malformed_schema_fails_only_its_own_request(tok, pool):
    futures = [
        pool.submit({"schema_type": "json", "schema": {"properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}}),
        pool.submit({"schema_type": "json", "schema": '{"type": "object", "properties": '}),
        pool.submit({"schema_type": "regex", "schema": "(ab"}),
        pool.submit({"schema_type": "ebnf", "schema": "root ::= undefined_rule"}),
        pool.submit({"schema_type": "regex", "schema": "[0-9]{2}"}),
    ]
    for bad in futures[1:4]:
        with pytest.raises(GrammarError) as info:
            bad.result(timeout=30)
        message = str(info.value)
        assert message.startswith("grammar compilation failed: ") and "\n" not in message
    states = [futures[0].result(timeout=30), None, futures[4].result(timeout=30)]
    params = [SamplingParams(max_tokens=100, seq_seed=i) for i in range(3)]
    a, free, digits = generate(tok, states, params, seed=3)
    assert json.loads(a.text)["a"] in (1, 2)
    assert free.finish_reason in ("stop", "length")
    assert re.fullmatch("[0-9]{2}", digits.text)


def test_an_invalid_so_args_shape_settles_as_a_grammar_error(pool):
    with pytest.raises(GrammarError, match="schema_type"):
        pool.submit({"schema_type": "yaml", "schema": "x"}).result(timeout=5)


def test_a_compile_past_the_timeout_is_an_error_for_that_request(tok):
    big = {
        "type": "object",
        "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{2,9}[0-9]{1,5}"} for i in range(200)},
    }
    with GrammarCompilerPool.for_tokenizer(tok, VOCAB, EOS, timeout_s=0.001) as slow:
        with pytest.raises(GrammarError, match=r"timed out after 0.001 s"):
            slow.submit({"schema_type": "json", "schema": big}).result(timeout=30)


def test_special_tokens_and_padding_ids_are_never_allowed_by_a_grammar(tok):
    with GrammarCompilerPool(tokenizer_info(tok, 520, [EOS])) as padded:
        state = padded.compile({"schema_type": "regex", "schema": ".{0,3}"})
    ok = allowed(state, 520)
    assert not ok[0] and not ok[2]  # begin-of-sentence and pad are special
    assert not ok[512:].any()
    assert ok[EOS]  # the empty string already matches: the stop token may end it


def test_free_text_until_the_trigger_sequence_then_the_grammar(tok, pool):
    a, b, c = single(tok, "<"), single(tok, ">"), single(tok, "x")
    state = pool.compile({"schema_type": "regex", "schema": "[0-9]{3}", "trigger_token_ids": [a, b]})
    assert allowed(state).all()
    for token in (a, c, b):  # a split trigger does not count
        assert state.accept_token(token)
    assert allowed(state).all() and state.phase == "free"
    state.accept_token(a)
    assert allowed(state).all()
    state.accept_token(b)
    digits = {single(tok, d) for d in "0123456789"}
    assert state.phase == "active"
    assert set(torch.nonzero(allowed(state)).flatten().tolist()) <= digits | {
        t for t in range(VOCAB) if tok.decode([t]).isdigit()
    }


def test_sampling_the_bound_token_forces_the_rest_of_the_trigger(tok, pool):
    a, b = single(tok, "<"), single(tok, ">")
    so = {"schema_type": "regex", "schema": "[0-9]{3}", "trigger_token_ids": [a, b], "bound_token_id": a}
    state = pool.compile(so)
    sampler = Sampler(VOCAB, EOS, tokenizer=tok)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    logits = torch.zeros(1, VOCAB)
    logits[0, a] = 10.0
    out = sampler.sample(logits, [SampleRow(params, 0, 0, [], [], state)])[0]
    assert out.token_id == a and state.phase == "forcing"
    # the model prefers a again, but only b is allowed now
    assert torch.nonzero(allowed(state)).flatten().tolist() == [b]
    assert sampler.sample(logits, [SampleRow(params, 0, 1, [a], [], state)])[0].token_id == b
    assert state.phase == "active"
    text = [a, b]
    while not state.is_terminated():
        row = SampleRow(params, 0, len(text), list(text), [], state)
        text.append(sampler.sample(torch.randn(1, VOCAB), [row])[0].token_id)
    assert re.fullmatch(r"<>[0-9]{3}", tok.decode(text))


def test_a_bound_token_outside_the_trigger_forces_the_whole_trigger(tok, pool):
    a, b, z = single(tok, "<"), single(tok, ">"), single(tok, "x")
    state = pool.compile({"schema_type": "regex", "schema": "[0-9]", "trigger_token_ids": [a, b], "bound_token_id": z})
    state.accept_token(z)
    assert torch.nonzero(allowed(state)).flatten().tolist() == [a]
    assert not state.accept_token(b)  # a forced token is the only one accepted
    assert state.accept_token(a) and torch.nonzero(allowed(state)).flatten().tolist() == [b]


def test_rollback_restores_the_mask_of_an_earlier_step(tok, pool):
    name_first = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    state = pool.compile({"schema_type": "json", "schema": name_first})
    for token in tok.encode('{"', add_special_tokens=False).ids:
        assert state.accept_token(token)
    before = allowed(state).clone()
    steps = state.num_accepted
    for token in tok.encode('name": "ab', add_special_tokens=False).ids:
        assert state.accept_token(token)
    assert not torch.equal(allowed(state), before)
    state.rollback(state.num_accepted - steps)
    assert torch.equal(allowed(state), before)


def test_rollback_across_the_trigger_returns_to_free_text(tok, pool):
    a, b = single(tok, "<"), single(tok, ">")
    state = pool.compile({"schema_type": "regex", "schema": "[0-9]{2}", "trigger_token_ids": [a, b]})
    state.accept_token(a)
    state.accept_token(b)
    grammar_start = allowed(state).clone()
    assert state.accept_token(single(tok, "7"))
    state.rollback(2)
    assert state.phase == "free" and allowed(state).all()
    state.accept_token(b)
    assert torch.equal(allowed(state), grammar_start)
    with pytest.raises(ValueError):
        state.rollback(5)


def test_sampling_past_the_end_of_a_grammar_is_an_error_for_that_row_only(tok, pool):
    state = pool.compile({"schema_type": "regex", "schema": "a"})
    assert state.accept_token(single(tok, "a")) and state.accept_token(EOS) and state.is_terminated()
    sampler = Sampler(VOCAB, EOS, tokenizer=tok)
    params = SamplingParams(temperature=0.0)
    outs = sampler.sample(torch.randn(2, VOCAB), [SampleRow(params, 0, 2, [], [], state), SampleRow(params, 0, 0)])
    assert outs[0].error is not None and outs[1].error is None
