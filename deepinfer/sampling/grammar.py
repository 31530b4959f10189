"""Structured outputs, compile side: xgrammar TokenizerInfo from a `tokenizers.Tokenizer`, and a compiler pool that
turns a request's so_args into a ready GrammarState off the step loop.

Why a pool with its own limits: xgrammar compiles in C++ and cannot be interrupted, so a pathological schema would
stall whoever waits on it. The step loop never waits: it polls the Future, which settles either with a
GrammarState or with a GrammarError (bad schema, too large, too many values or too deep, its client or the queue
at its bound, or no result within timeout_s of the compilation's start). Scheduling (lanes, fairness between
clients), the time bound and the containment of compilations that overrun are CompileQueue's (compile_queue.py,
which also says why threads and not processes).
"""

from __future__ import annotations

import json
import re
import weakref
from concurrent.futures import Future
from contextlib import AbstractContextManager

import xgrammar as xgr

from deepinfer.sampling import heap_trim
from deepinfer.sampling.compile_queue import ClientBusy, CompileQueue
from deepinfer.sampling.grammar_state import GrammarState
from deepinfer.sampling.json_schema_shim import rewrite_length_capped_strings
from deepinfer.sampling.literal_trie import factor_literal_alternations, literal_units
from deepinfer.sampling.params import _validate_so_args
from deepinfer.sampling.schema_limits import limits_error
from deepinfer.sampling.utf8_guard import Utf8Guard

DEFAULT_TIMEOUT_S = 20.0
DEFAULT_JSON_MAX_WHITESPACE = 32  # unbounded whitespace lets a weak model pad JSON forever
# Schema text larger than this is refused before compiling: compile time and memory grow with it (a 100,000-value
# enum, 1.4 MB, took 25 s and ~0.6 GB alone), so one request could otherwise hold a worker and memory for long.
DEFAULT_MAX_SCHEMA_BYTES = 1 << 20
# Bytes alone do not bound the cost: a 100,000-value enum of short strings fits in 1 MiB, and compile time grows
# faster than the number of values (2-core VM, loaded: 20,000 values 8 s, 50,000 values 70 s). So the values of a
# JSON schema (every enum value, property schema, keyword value: schema_limits.schema_values) are capped too.
DEFAULT_MAX_SCHEMA_VALUES = 32768
# ... and one whose grammar has more literal characters than this (literal_trie.literal_units, after the enum trie:
# about its states, each with a token-mask cache) is refused before it compiles. Why: a grammar's memory follows its
# states, not its schema's bytes; 10,000 enum values of 20 hex digits that share no prefix (220,040 units) held
# ~95 MB of the core's RSS while alive (embedded tokenizer, one compile: ~430 B a unit; a trie's units cost less),
# so one request could cost ~15% of a CPU core's RSS. At this bound a grammar costs at most ~30 MB.
DEFAULT_MAX_GRAMMAR_STATES = 65536
DEFAULT_LIVE_LIMIT_BYTES = 16 << 20  # the settings' default (config/schema.py) for callers without settings


class GrammarError(Exception):
    """A request's grammar cannot be used (malformed schema, compile failure or timeout). The message is one line;
    the engine ends only that request, with finish_reason="error" and this message. busy: refused for load (its
    client or the queue at its bound), not for what it asks: the same request may be taken later (HTTP 429)."""

    def __init__(self, message: str, busy: bool = False):
        super().__init__(message)
        self.busy = busy


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a `tokenizers.Tokenizer`. vocab_size: the logits' width (ids beyond the tokenizer's
    vocabulary are never allowed). stop_token_ids: what ends a grammar (usually [eos]).

    Special tokens are given an empty encoding, which xgrammar treats as "special": never allowed inside a
    grammar. Otherwise it would read e.g. '<｜begin▁of▁sentence｜>' as literal text and let it into a string,
    while detokenizing with skip_special_tokens drops it."""
    spec = json.loads(tokenizer.to_str())
    vocab_type, add_prefix_space = _vocab_metadata(spec)
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    encoded = [""] * vocab_size
    for token, idx in tokenizer.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size and idx not in special:
            encoded[idx] = token
    return xgr.TokenizerInfo(
        encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids, add_prefix_space=add_prefix_space
    )


def _vocab_metadata(spec: dict) -> tuple[xgr.VocabType, bool]:
    """How token strings map to bytes, read from tokenizer.json's decoder (and the pre-tokenizer for prefixes)."""
    decoder = spec.get("decoder") or {}
    decoders = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {d.get("type") for d in decoders}
    if "ByteLevel" in kinds:
        pre = spec.get("pre_tokenizer") or {}
        pres = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        prefix = any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in pres)
        return xgr.VocabType.BYTE_LEVEL, prefix
    if "ByteFallback" in kinds:
        prepend = any(d.get("type") == "Prepend" for d in decoders) or any(
            d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never" for d in decoders
        )
        return xgr.VocabType.BYTE_FALLBACK, prepend
    return xgr.VocabType.RAW, False


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[01:24:07] /project/cpp/x.cc:94: "


def one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    text = _XGRAMMAR_LOG_PREFIX.sub("", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class GrammarCompilerPool(AbstractContextManager):
    """Compiles so_args off the caller's thread. ``submit(so_args)`` returns a Future that settles with a fresh
    GrammarState for the request, or with a GrammarError. Light grammars (the light lane's, schema text up to
    CompileQueue.light_cost) are cached by xgrammar (keyed by the schema text) up to cache_limit_bytes (-1:
    unbounded); every request still gets its own matcher.

    Heavy grammars are compiled without the cache, and the heap is trimmed once each is released (heap_trim):
    measured on the embedded tokenizer, a 10,000-value enum compiled through the cache took ~6 s and kept +120 MB
    of RSS each (four: +469 MB after they were freed and trimmed, the cache holding them), and without it 0.8 s and
    +48 MB for all four after they were freed and trimmed. The cache would hold each heavy grammar until
    cache_limit_bytes evicts it (1 GiB by default), for a schema that is rarely sent twice; a repeated one is
    compiled again (0.8 s for this one, in its lane). Compiling in a child process was measured too and is no
    better: a deserialized grammar costs the core as much as compiling it, and serialize_json is 115 MB of text
    for this enum (~1 GB of transient RSS in the core to read it back).

    cache_limit_bytes: config value (env DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES). timeout_s: config value (env
    DEEPINFER_XGRAMMAR_TIMEOUT, 20 s), counted from the compilation's start. max_schema_bytes: larger schemas are
    refused at once. max_workers: kept for callers; the queue runs one light and one heavy lane. live_limit_bytes:
    a heavy compilation starts only while the heavy grammars alive (compiled, not yet released by their requests)
    hold fewer bytes than this (xgrammar's memory_size_bytes; 0: one at a time; None: no bound); the rest wait, so a
    flood of heavy schemas costs the core about one limit's worth of memory, not one grammar per request (soak:
    four 10,000-value enums alive at once were +171 MB of the core's RSS, 31 MiB each as compiled).
    json_max_whitespace: whitespace characters allowed between JSON elements."""

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        max_workers: int = 2,
        cache_limit_bytes: int = -1,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        json_max_whitespace: int | None = DEFAULT_JSON_MAX_WHITESPACE,
        max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES,
        max_queued: int = 64,
        max_schema_values: int = DEFAULT_MAX_SCHEMA_VALUES,
        max_grammar_states: int = DEFAULT_MAX_GRAMMAR_STATES,
        heavy_lanes: int = 2,
        max_per_client: int = 4,
        live_limit_bytes: int | None = DEFAULT_LIVE_LIMIT_BYTES,
    ):
        if timeout_s <= 0:
            raise ValueError(f"GrammarCompilerPool.timeout_s={timeout_s!r} is out of range; allowed: (0, inf)")
        self.timeout_s = timeout_s
        self.json_max_whitespace = json_max_whitespace
        self.max_schema_bytes, self.max_schema_values = max_schema_bytes, max_schema_values
        self.max_grammar_states = max_grammar_states
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=cache_limit_bytes)
        self._heavy_compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._utf8_guard = Utf8Guard(info.decoded_vocab, info.vocab_size)
        self.live_limit_bytes = live_limit_bytes
        self._live_bytes = 0  # heavy grammars' bytes alive; changed under the queue's lock
        self._queue = CompileQueue(
            timeout_s, lambda: GrammarError(f"grammar compilation timed out after {timeout_s:g} s"),
            max_queued=max_queued, heavy_lanes=heavy_lanes, max_per_client=max_per_client,
            heavy_room=None if live_limit_bytes is None else self._heavy_room,
        )

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_id: int, **kwargs) -> "GrammarCompilerPool":
        return cls(tokenizer_info(tokenizer, vocab_size, [eos_token_id]), **kwargs)

    def submit(self, so_args: dict, alive=None, client: str = "") -> Future:
        """Starts compiling; never blocks and never raises (errors arrive through the Future). alive(): False once
        the request is gone, so a compilation still waiting for its turn is skipped. client: who sent it (the
        server's tag; "" for the offline API), for the queue's fairness and per-client bound."""
        try:
            _validate_so_args(so_args)
            size, too_large = limits_error(so_args, self.max_schema_bytes, self.max_schema_values)
            if too_large is not None:
                raise GrammarError(f"so_args['schema'] {too_large}")
            heavy = size > self._queue.light_cost
            job = self._queue.submit(lambda: self._build_state(so_args, heavy), cost=size, alive=alive, client=client)
        except (ValueError, GrammarError, ClientBusy, RuntimeError) as error:  # RuntimeError: closed
            done: Future = Future()
            done.set_running_or_notify_cancel()
            if isinstance(error, ClientBusy):
                error = GrammarError(one_line(error), busy=True)
            done.set_exception(error if isinstance(error, GrammarError) else GrammarError(one_line(error)))
            return done
        result: Future = Future()
        result.set_running_or_notify_cancel()
        job.add_done_callback(lambda j: _relay(j, result))
        return result

    def compile(self, so_args: dict) -> GrammarState:
        """Blocking form of submit (tests, tools): the GrammarState, or raises GrammarError."""
        return self.submit(so_args).result()

    def close(self) -> None:
        self._queue.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def _build_state(self, so_args: dict, heavy: bool = False) -> GrammarState:
        compiler = self._heavy_compiler if heavy else self._compiler
        compiled = self._compile(compiler, so_args["schema_type"], so_args["schema"])
        trigger, bound = so_args.get("trigger_token_ids"), so_args.get("bound_token_id")
        state = GrammarState(compiled, trigger, bound, self._utf8_guard)
        if heavy:
            # The state holds the only reference to an uncached grammar: once the request drops it, the grammar
            # is freed, its pages can go back to the OS, and the next heavy compilation may start.
            size = compiled.memory_size_bytes
            del compiled
            self._add_live(size)
            weakref.finalize(state, self._released, size).atexit = False  # no thread started at interpreter exit
        return state

    def _heavy_room(self) -> bool:
        return self._live_bytes == 0 or self._live_bytes < self.live_limit_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes of the heavy grammars alive (compiled and not yet released by their requests)."""
        return self._live_bytes

    def _add_live(self, size: int) -> None:
        with self._queue._lock:
            self._live_bytes += size

    def _released(self, size: int) -> None:
        self._add_live(-size)
        heap_trim.request()
        self._queue.wake()

    def _compile(self, compiler: xgr.GrammarCompiler, schema_type: str, schema) -> xgr.CompiledGrammar:
        if schema_type == "json":
            parsed = json.loads(schema) if isinstance(schema, str) else schema  # clear "invalid JSON" errors
            # Not sort_keys: the order of "properties" is the order the fields are generated in.
            text = json.dumps(rewrite_length_capped_strings(parsed))
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=True,
                                                   max_whitespace_cnt=self.json_max_whitespace)
            factored = factor_literal_alternations(str(grammar))  # long enums as tries (literal_trie.py)
            self._check_states(str(grammar) if factored is None else factored)
            return compiler.compile_grammar(grammar if factored is None else factored)
        grammar = xgr.Grammar.from_regex(schema) if schema_type == "regex" else xgr.Grammar.from_ebnf(schema)
        self._check_states(str(grammar))
        return compiler.compile_grammar(grammar)

    def _check_states(self, ebnf: str) -> None:
        states = literal_units(ebnf)
        if states > self.max_grammar_states:
            raise GrammarError(f"so_args['schema'] makes a grammar of {states} literal characters (its states, after "
                               f"shared prefixes); allowed: at most {self.max_grammar_states} "
                               "(sampling.xgrammar_max_grammar_states)")


def _relay(job: Future, result: Future) -> None:
    """Every failure the request sees is a one-line GrammarError."""
    error = job.exception()
    if error is None:
        result.set_result(job.result())
    elif isinstance(error, GrammarError):
        result.set_exception(error)
    elif isinstance(error, RecursionError):
        result.set_exception(GrammarError("grammar compilation failed: the schema is nested too deeply"))
    else:
        result.set_exception(GrammarError(f"grammar compilation failed: {one_line(error)}"))
