"""The one frontend (deepinfer/frontend): the input processor (validation, the seed rule, n-expansion), the output
processor (DecodeStream text, the stop-string cut, stop tokens, deltas) and the sync loop (generate_iter is the loop
itself: no thread, several open at once)."""

import threading

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.messages import RequestUpdate
from deepinfer.frontend import InputProcessor, OutputProcessor
from deepinfer.frontend.input_processor import EngineInput
from deepinfer.sampling import child_seed, seed_for
from model_fixtures import EOS, text_ids, tokenizer


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


ids = text_ids


# ---- input processor -------------------------------------------------------------------------------------------
def test_the_seed_rule_and_n_expansion():
    inp = InputProcessor(base_seed=7)
    (a,) = inp.process(0, None, [1, 2], SamplingParams())
    assert (a.request_id, a.seed) == (0, child_seed(7, 0))
    (b,) = inp.process(1, None, [1, 2], SamplingParams(seq_seed=99))
    assert (b.request_id, b.seed) == (1, 99)
    samples = inp.process(2, None, [1, 2], SamplingParams(n=3))
    parent = child_seed(7, 2)
    assert [s.request_id for s in samples] == [2, 3, 4]  # sample i > 0 takes the next free id
    assert [s.seed for s in samples] == [child_seed(parent, i) for i in range(3)] == [s.params.seq_seed for s in samples]
    assert samples[0].seed == parent and all(s.params.n == 1 for s in samples)
    assert seed_for(None, 7, 2) == parent and seed_for(5, 7, 2) == 5


def test_invalid_inputs_become_one_error_request_each():
    inp = InputProcessor(encode=lambda text: [0, *map(ord, text)])
    bad = SamplingParams()
    bad.max_tokens = None
    cases = [(None, 5, SamplingParams(), "prompt_token_ids=5 is not a list of token ids"),
             (7, None, SamplingParams(), "prompt 7 is not a string"),
             (None, [1, "x"], SamplingParams(), "prompt token ids must be integers"),
             ("ab", None, bad, "SamplingParams.max_tokens=None is out of range")]
    for text, prompt_ids, params, message in cases:
        (one,) = inp.process(0, text, prompt_ids, params)
        assert one.error is not None and one.error.startswith(message) and one.seed is None
    (ok,) = inp.process(0, "ab", None, SamplingParams())
    assert ok.error is None and ok.prompt_ids == [0, 97, 98]


# ---- output processor ------------------------------------------------------------------------------------------
def state_for(tok, params, skip_special_tokens=True):
    out = OutputProcessor(tok, EOS, skip_special_tokens)
    return out.new_state(EngineInput(0, 0, 0, None, [0], params, 1), engine_id=0)


def feed(st, tokens, finish=None, step=2):
    for i in range(0, len(tokens), step):
        last = i + step >= len(tokens)
        st.apply(RequestUpdate(0, token_ids=tokens[i:i + step], logprobs=[None] * len(tokens[i:i + step]),
                               finish_reason=finish if last else None), 0.0)


def test_text_is_the_full_decode_without_the_final_stop_token(tok):
    text = "日本語 ok ünï"
    st = state_for(tok, SamplingParams(max_tokens=50))
    feed(st, ids(tok, text) + [EOS], "stop")
    assert st.output().text == text and st.output().token_ids[-1] == EOS


def test_the_text_is_cut_before_a_stop_string(tok):
    tokens = ids(tok, "Hello world")
    st = state_for(tok, SamplingParams(stop=["o w"], max_tokens=50))
    feed(st, tokens[:4], "stop")
    assert st.output().text == "Hell"


def test_an_aborted_request_shows_everything_generated_an_unfinished_character_as_ufffd(tok):
    tokens = ids(tok, "ab日")[:-1]  # the last character's bytes are incomplete
    st = state_for(tok, SamplingParams(max_tokens=50))
    feed(st, tokens, "abort")
    assert st.output().text == tok.decode(tokens) and st.output().text.endswith("\ufffd")


def test_text_deltas_add_up_and_count_every_token(tok):
    text = "a日b"
    tokens = ids(tok, text)
    st = state_for(tok, SamplingParams(max_tokens=50), skip_special_tokens=False)
    pieces, counts = [], []
    for i, t in enumerate(tokens + [EOS]):
        last = i == len(tokens)
        st.apply(RequestUpdate(0, token_ids=[t], logprobs=[None], finish_reason="stop" if last else None), 0.0)
        piece, count = st.text_delta()
        pieces.append(piece)
        counts.append(count)
    assert "".join(pieces) == text and sum(counts) == len(tokens) + 1
    assert 0 in counts  # a token that only began a character waits for the one completing it


# ---- the sync loop ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    with LLM(model="tiny", hardware="cpu", process="inproc", runtime={"num_threads": 1, "seed": 0}) as llm:
        yield llm


def test_generate_iter_runs_in_the_callers_thread_and_open_streams_interleave(llm):
    sp = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)
    prompts = ["def f(", "import os"]
    threads = threading.active_count()
    a = llm.generate_iter(prompts, sp)
    first = next(a)
    b = llm.generate_iter(prompts, sp)
    got_a, got_b = [first], []
    for x, y in zip(a, b):  # both advance one update at a time; each sees only its own requests
        got_a.append(x)
        got_b.append(y)
        assert threading.active_count() <= threads
    got_a += list(a)
    got_b += list(b)
    outs_a = [u.output for u in got_a if u.output is not None]
    outs_b = [u.output for u in got_b if u.output is not None]
    for outs in (outs_a, outs_b):
        assert [o.prompt for o in outs] == prompts and all(len(o.token_ids) == 6 for o in outs)
    for i in range(2):
        assert sum((u.token_ids for u in got_a if u.index == i and u.output is None), []) == outs_a[i].token_ids
        assert sum((u.token_ids for u in got_b if u.index == i and u.output is None), []) == outs_b[i].token_ids
    assert [o.request_id for o in outs_b] == [o.request_id + 2 for o in outs_a]
