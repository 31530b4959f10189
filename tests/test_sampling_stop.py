"""StopChecker with the fixture's byte-level BPE tokenizer: stop strings across token and UTF-8 boundaries,
stop_token_ids, EOS, ignore_eos, min_tokens, max_tokens, grammar termination."""

import pytest

from deepinfer.sampling import SamplingParams, StopChecker
from model_fixtures import EOS, text_ids, tokenizer


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


ids = text_ids


def run(tok, params, token_ids, grammar_done_at=None):
    checker = StopChecker(params, tok, EOS)
    for i, token in enumerate(token_ids):
        if checker.append(token, grammar_terminated=(i == grammar_done_at)):
            break
    return checker


def test_stop_string_spanning_two_tokens_is_found_and_cut(tok):
    tokens = ids(tok, "Hello world")  # H | el | lo | ' w' | or | l | d
    assert len(tokens) == 7
    checker = run(tok, SamplingParams(stop=["o w"], max_tokens=50), tokens)
    assert checker.finish_reason == "stop"
    assert checker.text == "Hell"
    assert checker.token_ids == tokens[:4]  # stops on the token that completes the stop string


def test_stop_string_inside_a_multibyte_character_split_across_tokens(tok):
    tokens = ids(tok, "ünïcødé")  # every accented letter is two byte-level tokens
    checker = run(tok, SamplingParams(stop=["ø"], max_tokens=50), tokens)
    assert (checker.finish_reason, checker.text) == ("stop", "ünïc")
    assert checker.token_ids == tokens[:8]


def test_the_earliest_of_several_stop_strings_wins(tok):
    checker = run(tok, SamplingParams(stop=["here", ". S"], max_tokens=50), ids(tok, "The end. STOP here"))
    assert (checker.finish_reason, checker.text) == ("stop", "The end")


def test_without_a_stop_the_text_is_the_full_detokenization(tok):
    text = "日本語 ok"
    tokens = ids(tok, text)
    checker = run(tok, SamplingParams(stop=["zzz"], max_tokens=len(tokens)), tokens)
    assert (checker.finish_reason, checker.text) == ("length", text)


def test_an_unfinished_utf8_tail_is_replaced_when_the_request_ends(tok):
    tokens = ids(tok, "日本")[:-1]  # the last character is cut mid-sequence
    checker = run(tok, SamplingParams(max_tokens=len(tokens)), tokens)
    assert checker.text == "日\ufffd"


def test_stop_token_ids_and_eos_stop_without_adding_text(tok):
    tokens = ids(tok, "Hello") + [EOS] + ids(tok, " more")
    checker = run(tok, SamplingParams(max_tokens=50), tokens)
    assert (checker.finish_reason, checker.text, checker.token_ids) == ("stop", "Hello", ids(tok, "Hello") + [EOS])
    stop_id = ids(tok, "#")[0]
    checker = run(tok, SamplingParams(max_tokens=50, stop_token_ids=[stop_id]), ids(tok, "ab") + [stop_id, 67])
    assert (checker.finish_reason, checker.text) == ("stop", "ab")


def test_ignore_eos_keeps_going_until_length(tok):
    tokens = ids(tok, "Hi") + [EOS] + ids(tok, "yo")
    checker = run(tok, SamplingParams(max_tokens=len(tokens), ignore_eos=True), tokens)
    assert (checker.finish_reason, checker.text, checker.token_ids) == ("length", "Hiyo", tokens)


def test_stops_before_min_tokens_are_ignored(tok):
    tokens = [EOS] + ids(tok, "a##") + ids(tok, "#") + ids(tok, "b") + [EOS]  # EOS | a | ## | # | b | EOS
    checker = run(tok, SamplingParams(max_tokens=50, min_tokens=3, stop=["#"]), tokens)
    # the EOS at position 0 and the '##' at position 2 come too early; the '#' at position 3 counts
    assert checker.finish_reason == "stop"
    assert checker.token_ids == tokens[:4]
    assert checker.text == "a##"


def test_max_tokens_gives_length_and_a_stop_on_the_last_token_gives_stop(tok):
    tokens = ids(tok, "Hello world")
    assert run(tok, SamplingParams(max_tokens=3), tokens).finish_reason == "length"
    assert run(tok, SamplingParams(max_tokens=3, stop=["ll"]), tokens).finish_reason == "stop"


def test_a_terminated_grammar_stops_the_request(tok):
    checker = run(tok, SamplingParams(max_tokens=50), ids(tok, "Hello world"), grammar_done_at=2)
    assert (checker.finish_reason, checker.text) == ("stop", "Hello")


def test_streamable_text_holds_back_a_possible_stop_prefix(tok):
    checker = StopChecker(SamplingParams(stop=["###"], max_tokens=50), tok, EOS)
    for token in ids(tok, "abc#"):
        checker.append(token)
    assert checker.text == "abc#"
    assert checker.streamable_text == "ab"


def test_append_after_finishing_is_a_bug(tok):
    checker = run(tok, SamplingParams(max_tokens=1), ids(tok, "ab"))
    with pytest.raises(RuntimeError):
        checker.append(5)
