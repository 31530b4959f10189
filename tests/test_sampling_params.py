"""SamplingParams: defaults, and a one-line ValueError naming field, value and allowed range for bad values."""

import pytest

from deepinfer.sampling import SamplingParams


def test_defaults_match_the_documented_api():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.n) == (16, 0, False, 1)
    assert (p.stop, p.stop_token_ids, p.so_args, p.seq_seed) == (None, None, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.top_logprobs, p.prompt_logprobs) == (0, False)


def test_greedy_below_1e_5_temperature():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_p": 2.0}, "SamplingParams.top_p=2.0 is out of range; allowed: (0, 1]"),
        ({"top_p": 0.0}, "SamplingParams.top_p=0.0 is out of range; allowed: (0, 1]"),
        ({"temperature": -0.1}, "SamplingParams.temperature=-0.1 is out of range; allowed: [0, inf)"),
        ({"temperature": float("nan")}, "SamplingParams.temperature=nan is out of range"),
        ({"top_k": 0}, "SamplingParams.top_k=0 is out of range; allowed: -1 (off) or an integer >= 1"),
        ({"min_p": 1.5}, "SamplingParams.min_p=1.5 is out of range; allowed: [0, 1]"),
        ({"max_tokens": -1}, "SamplingParams.max_tokens=-1 is out of range; allowed: an integer >= 1"),
        ({"min_tokens": 17}, "SamplingParams.min_tokens=17 is out of range; allowed: an integer in [0, max_tokens=16]"),
        ({"presence_penalty": 3}, "SamplingParams.presence_penalty=3 is out of range; allowed: [-2, 2]"),
        ({"frequency_penalty": -2.5}, "SamplingParams.frequency_penalty=-2.5 is out of range; allowed: [-2, 2]"),
        ({"repetition_penalty": 0.0}, "SamplingParams.repetition_penalty=0.0 is out of range; allowed: (0, inf)"),
        ({"n": 0}, "SamplingParams.n=0 is out of range; allowed: an integer >= 1"),
        ({"top_logprobs": 1001}, "SamplingParams.top_logprobs=1001 is out of range; allowed: an integer in [0, 1000]"),
        ({"seq_seed": 2**64}, "SamplingParams.seq_seed=18446744073709551616 is out of range"),
        ({"seq_seed": -1}, "SamplingParams.seq_seed=-1 is out of range"),
        ({"stop": [""]}, "SamplingParams.stop=[''] is out of range; allowed: None or a list of non-empty strings"),
        ({"stop_token_ids": [-3]}, "SamplingParams.stop_token_ids=[-3] is out of range"),
        ({"max_tokens": True}, "SamplingParams.max_tokens=True is out of range"),
        ({"so_args": {"schema_type": "xml", "schema": "x"}}, "SamplingParams.so_args['schema_type']='xml'"),
        ({"so_args": {"schema_type": "regex", "schema": {}}}, "so_args['schema']={} is out of range; allowed: a str"),
        ({"so_args": {"schema_type": "json", "schema": "{}", "bound_token_id": 5}}, "only together with trigger"),
        ({"so_args": {"schema_type": "json", "schema": "{}", "trigger_token_ids": []}}, "trigger_token_ids']=[]"),
        ({"so_args": {"schema_type": "json", "schema": "{}", "oops": 1}}, "unknown: ['oops']"),
    ],
)
def test_bad_value_raises_one_line_error_naming_field_value_and_range(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_edge_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, min_tokens=16, top_logprobs=1000)
    SamplingParams(seq_seed=0)
    SamplingParams(seq_seed=2**64 - 1)
    so_args = {"schema_type": "json", "schema": {"type": "object"}, "trigger_token_ids": [5], "bound_token_id": 5}
    SamplingParams(so_args=so_args)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
