"""Heavy grammars (schema text past the light lane's bound) are compiled without xgrammar's cache and the heap is
trimmed once each is released, so a grammar flood leaves the engine core's RSS where it was (issue 25's soak: +760
MB in the core after four 10,000-value enums, all of it kept)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from deepinfer import LLM
from deepinfer.sampling import SamplingParams
from deepinfer.sampling.bitmask import allocate_bitmask, unpack_bitmask
from deepinfer.sampling.grammar import GrammarCompilerPool, GrammarError
from serving_helpers import peak_rss_bytes, rss_bytes, wait_for

TOKENIZER = Path(__file__).parent / "fixtures/deepseek_v41/tiny-engram-hc4/tokenizer.json"
VOCAB, EOS = 512, 1


def enum_schema(n: int, tag: str) -> dict:
    return {"type": "object", "properties": {"x": {"enum": [f"{tag}v{i}" for i in range(n)]}}, "required": ["x"]}


def unshared_enum_schema(n: int, tag: str) -> dict:
    """Values that share no prefixes (12 hash digits), so the pool's enum trie (sampling/literal_trie.py) leaves the
    grammar as large as xgrammar compiles it: 33 MiB at 10,000 values on the embedded tokenizer."""
    values = [hashlib.sha1(f"{tag}v{i}".encode()).hexdigest()[:12] for i in range(n)]
    return {"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]}


def masks(state, tok, text: str) -> list[torch.Tensor]:
    """The allowed tokens before each token of `text`, and after the last."""
    out = []
    for token in tok.encode(text, add_special_tokens=False).ids + [None]:
        mask = allocate_bitmask(1, VOCAB)
        state.fill_bitmask(mask, 0)
        out.append(unpack_bitmask(mask, VOCAB)[0])
        if token is not None:
            assert state.accept_token(token)
    return out


def test_a_heavy_grammar_compiled_without_the_cache_allows_the_same_tokens_and_is_not_cached():
    tok = Tokenizer.from_file(str(TOKENIZER))
    so_args = {"schema_type": "json", "schema": json.dumps(enum_schema(2000, "k"))}
    assert len(so_args["schema"]) > 16 * 1024  # the heavy lane's
    with GrammarCompilerPool.for_tokenizer(tok, VOCAB, EOS) as pool:
        heavy = pool.compile(so_args)
        assert pool._compiler.get_cache_size_bytes() == 0
        cached = pool._build_state(so_args, heavy=False)
        assert pool._compiler.get_cache_size_bytes() > 0
        text = '{"x": "kv1234"}'
        got, want = masks(heavy, tok, text), masks(cached, tok, text)
    assert len(got) == len(want) > 3
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}"
    assert not bool(got[-1][:EOS].any()) and bool(got[-1][EOS])  # the end: only EOS


def test_a_grammar_past_the_states_bound_is_refused_before_it_compiles_in_one_line():
    """10,000 values of 12 hash digits: 140,040 literal characters, ~33 MiB compiled (~60 MB of RSS alive); refused
    at the default bound with a line naming the knob, compiled under a raised one."""
    tok = Tokenizer.from_file(str(TOKENIZER))
    so_args = {"schema_type": "json", "schema": unshared_enum_schema(10_000, "s")}
    with GrammarCompilerPool.for_tokenizer(tok, VOCAB, EOS) as pool:
        with pytest.raises(GrammarError) as err:
            pool.compile(so_args)
    message = str(err.value)
    assert message.startswith("so_args['schema'] makes a grammar of 140040 literal characters") and "\n" not in message
    assert message.endswith("allowed: at most 65536 (sampling.xgrammar_max_grammar_states)")
    with GrammarCompilerPool.for_tokenizer(tok, VOCAB, EOS, max_grammar_states=1 << 18) as pool:
        assert pool.compile(so_args) is not None


def test_a_heavy_grammar_waits_while_the_live_ones_hold_the_limit_and_compiles_once_they_are_released():
    """live_limit_bytes=0: one heavy grammar alive at a time. The second compiles only after the first's state is
    released, and the live bytes are xgrammar's own count of each grammar, back to 0 at the end."""
    import gc

    tok = Tokenizer.from_file(str(TOKENIZER))
    so_args = [{"schema_type": "json", "schema": json.dumps(enum_schema(2000, tag))} for tag in "ab"]
    with GrammarCompilerPool.for_tokenizer(tok, VOCAB, EOS, live_limit_bytes=0) as pool:
        looks = []
        room = pool._queue._lanes["heavy"].room
        pool._queue._lanes["heavy"].room = lambda: looks.append(pool.live_bytes) or room()
        first = pool.submit(so_args[0]).result(60)
        assert pool.live_bytes > 0
        second = pool.submit(so_args[1])
        assert wait_for(lambda: len(looks) >= 2, timeout=60.0)  # the worker looked with the first alive
        assert not second.done() and looks[-1] == pool.live_bytes > 0
        del first
        gc.collect()
        state = second.result(60)
        assert pool.live_bytes > 0 and masks(state, tok, '{"x": "bv7"}')[-1][EOS]
        del state, second  # the Future holds its result too
        gc.collect()
        assert pool.live_bytes == 0


def test_the_engine_cores_rss_does_not_keep_heavy_grammars_after_their_requests_end():
    """Eight rounds of four 4,500-value enums whose values share no prefixes (63,040 literal characters, under the
    states bound; ~15 MiB each as compiled grammars: the enum trie cannot shrink them), in a core process like the
    server's (the numbers below were measured with 10,000 such values, 33 MiB each, before the states bound). Before: through xgrammar's cache, and
    with the compile queue's idle threads holding their last result, the core kept +770 MB after two (the soak's
    +760 MB). Now, once their requests end and the heap is trimmed, and with the core's malloc arenas capped
    (heap_trim.limit_arenas), less than one grammar's worth after every round, and its peak under three (measured
    with the 31 MiB enums of prefixed values this test used before the trie: +2 to +34 MB kept over eight rounds and
    +99 MB at the peak before the cap; +4 to +5 MB kept and +56 MB at the peak with it)."""
    def params(tag: str, seed: int) -> SamplingParams:
        so_args = {"schema_type": "json", "schema": unshared_enum_schema(4_500, tag)}
        return SamplingParams(temperature=0.8, max_tokens=8, seq_seed=seed, so_args=so_args)

    with LLM(process="subprocess") as llm:
        pid = llm._engine.client.process.pid
        llm.generate(["x"], [params("warm", 0)], use_tqdm=False)  # one-time costs: threads, the compilers
        before = rss_bytes(pid)
        grown = lambda: rss_bytes(pid) - before  # noqa: E731
        for r in range(8):
            outs = llm.generate(["x"] * 4, [params(f"r{r}k{k}", k) for k in range(4)], use_tqdm=False)
            assert all(o.finish_reason != "error" for o in outs)
            # The trim runs on the core's own thread after the requests end: wait for it, bounded.
            assert wait_for(lambda: grown() < 24 * 2**20, timeout=30.0), \
                f"the core's RSS did not come back after round {r}: +{grown() >> 20} MB"
        peak = peak_rss_bytes(pid) - before
        assert peak < 90 * 2**20, f"the core's peak RSS in the floods: +{peak >> 20} MB"


def test_the_engine_cores_malloc_arenas_are_capped_unless_the_operator_set_them(monkeypatch):
    import ctypes.util

    from deepinfer.sampling import heap_trim

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert heap_trim.limit_arenas() is False  # glibc applied the operator's value at start
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    glibc = ctypes.util.find_library("c") is not None
    assert heap_trim.limit_arenas(8) is glibc  # 8: this test process's own cap, as loose as glibc's usual
