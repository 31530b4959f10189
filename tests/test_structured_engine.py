"""Structured outputs through the engine, on the embedded model with temperature sampling (CPU).

The embedded model is tiny and untrained, so whatever it writes inside a grammar is the grammar's doing: every
JSON request must parse and validate, every regex / EBNF request must match in full, in both scheduling modes.
"""

import json
import re

import jsonschema
import pytest

from deepinfer import LLM
from deepinfer.sampling import SamplingParams

EOS = 1  # the embedded model's
VOCAB = 512
# Bounds on lengths and counts so that a random model finishes within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.com"
EBNF = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-z]{1,5} | [0-9]{1,3}'
EBNF_AS_REGEX = r"\[(?:[a-z]{1,5}|[0-9]{1,3})(?:,(?:[a-z]{1,5}|[0-9]{1,3})){0,3}\]"


def params(seed, so_args=None, max_tokens=256):
    return SamplingParams(temperature=0.8, max_tokens=max_tokens, seq_seed=seed, so_args=so_args)


def mixed_batch():
    ps = [params(100 + i, {"schema_type": "json", "schema": SCHEMA}) for i in range(20)]
    ps.append(params(7, {"schema_type": "json", "schema": '{"type": "object", "properties": '}))  # malformed
    ps.append(params(8, {"schema_type": "regex", "schema": REGEX}, 64))
    ps.append(params(9, {"schema_type": "ebnf", "schema": EBNF}, 64))
    ps.append(params(10, max_tokens=12))  # unconstrained, in the same batch
    return ps


@pytest.mark.parametrize("zero_overhead", [False, True])
def test_json_regex_ebnf_and_a_malformed_schema_in_one_batch(zero_overhead):
    ps = mixed_batch()
    with LLM("tiny_random", engine={"zero_overhead_scheduling": zero_overhead}) as llm:
        outs = llm.generate([f"request {i}:" for i in range(len(ps))], ps, use_tqdm=False)
    for out in outs[:20]:
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    bad = outs[20]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error.startswith("grammar compilation failed:") and "\n" not in bad.error
    assert outs[21].finish_reason == "stop" and re.fullmatch(REGEX, outs[21].text), outs[21].text
    assert outs[22].finish_reason == "stop" and re.fullmatch(EBNF_AS_REGEX, outs[22].text), outs[22].text
    assert outs[23].finish_reason in ("stop", "length") and outs[23].error is None


@pytest.mark.slow  # 22 s on the 2-core CI VM: the slow tier
def test_grammar_requests_survive_preemption_unchanged():
    """A 21-block cache preempts these requests again and again (with async scheduling, often while one of
    their samples is in flight, whose token is dropped): each recompute must roll the matcher back to the
    request's output, so every request samples what it samples with a cache that never preempts."""
    ps = [params(200 + i, {"schema_type": "json", "schema": SCHEMA}) for i in range(8)]
    prompts = [f"p{i}" for i in range(8)]
    with LLM("tiny_random", process="inproc") as llm:
        roomy = llm.generate(prompts, ps, use_tqdm=False)
    with LLM("tiny_random", process="inproc", cache={"memory_budget": 200_000, "block_size": 16}) as llm:
        tight = llm.generate(prompts, ps, use_tqdm=False)
        assert llm.last_metrics["preemptions"] > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for out in tight:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_trigger_tokens_leave_free_text_then_follow_the_grammar():
    """The grammar starts after the trigger: before it the request samples freely (exactly the tokens an
    unconstrained request with the same seed samples, since draws depend on seed and position only)."""
    prompt, seed = "think first", 31
    with LLM("tiny_random", process="inproc") as llm:
        free = llm.generate([prompt], params(seed, max_tokens=8), use_tqdm=False)[0].token_ids
        assert len(free) >= 4 and EOS not in free[:4]
        trigger = free[2:4]
        start = next(j for j in range(len(free)) if free[j : j + 2] == trigger) + 2  # where the grammar begins
        so_args = {"schema_type": "regex", "schema": REGEX, "trigger_token_ids": trigger}
        out = llm.generate([prompt], params(seed, so_args, max_tokens=64), use_tqdm=False)[0]
        tail = out.token_ids[start:]
        assert out.finish_reason == "stop" and out.token_ids[:start] == free[:start]
        assert tail[-1] == EOS and re.fullmatch(REGEX, llm.tokenizer.decode(tail[:-1]))


def test_compile_timeout_from_the_settings_ends_only_grammar_requests():
    with LLM("tiny_random", process="inproc", sampling={"xgrammar_timeout": 1e-6}) as llm:
        outs = llm.generate(["a", "b"], [params(1, {"schema_type": "json", "schema": SCHEMA}), params(2, max_tokens=5)],
                            use_tqdm=False)
    assert outs[0].finish_reason == "error" and "timed out" in outs[0].error
    assert outs[1].finish_reason in ("stop", "length") and outs[1].error is None


def test_scheduler_prefills_while_the_grammar_compiles_but_samples_only_when_ready():
    """Pure scheduling: a request whose grammar compiles runs its prompt up to the last token; a one-token prompt
    waits outside without blocking later arrivals; both are sampled only once their grammar is there."""
    from deepinfer.engine.cache_manager import CacheManager
    from deepinfer.engine.request import Request
    from deepinfer.engine.scheduler import Scheduler

    sched = Scheduler(CacheManager(num_slots=8, num_blocks=256, block_size=16), 8, 64, 512, VOCAB)
    long_, short, plain = (Request(i, ids, params(i, max_tokens=4), i) for i, ids in enumerate([[5] * 10, [6], [7, 8]]))
    long_.grammar_pending = short.grammar_pending = True
    for req in (long_, short, plain):
        assert sched.add(req) is None
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in plan.rows] == [(0, 9, False), (2, 2, True)]
    assert list(sched.waiting) == [short]
    assert [r.request_id for r in sched.schedule().rows] == [2]  # nothing may run for 0 and 1 yet
    long_.grammar_state, long_.grammar_pending = "state0", False
    short.grammar_state, short.grammar_pending = "state1", False
    plan = sched.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample, r.grammar) for r in plan.rows if r.request_id != 2] == [
        (0, 1, True, "state0"),
        (1, 1, True, "state1"),
    ]


@pytest.mark.parametrize("zero_overhead", [False, True])
def test_a_grammar_that_cannot_continue_errors_only_its_request(zero_overhead):
    """min_tokens keeps EOS out while the grammar allows nothing but EOS: that request ends with an error (with
    async scheduling, while a row of it is already planned), the others in its steps are unaffected."""
    stuck = SamplingParams(temperature=0.8, max_tokens=16, min_tokens=12, seq_seed=3,
                           so_args={"schema_type": "regex", "schema": "ab"})
    others = [params(40 + i, max_tokens=16) for i in range(3)]
    with LLM("tiny_random", process="inproc", engine={"zero_overhead_scheduling": zero_overhead}) as llm:
        expected = llm.generate(["x", "y", "z"], others, use_tqdm=False)
        outs = llm.generate(["w", "x", "y", "z"], [stuck, *others], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "no token is allowed" in outs[0].error
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in expected]
