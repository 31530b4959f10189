"""cache_salt (vLLM's per-request field) isolates prefix-cache tenants: a salted request never starts from a prefix
computed by an unsalted or differently salted one (0 cached tokens, 0 hit tokens in the run's metrics), requests
with the same salt do share, and unsalted requests share with each other; every output is bitwise what the cache
off gives. A salt that is not a non-empty string of at most MAX_CACHE_SALT_CHARS characters ends its request alone
with a one-line error, at the frontend and again where the core takes the request."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine import messages as m
from deepinfer.engine.prefix_cache import MAX_CACHE_SALT_CHARS, cache_salt_error, root_key
from deepinfer.frontend import LLMEngine
from deepinfer.sampling import SamplingParams
from options_helpers import settings_for

BLOCK = 16


def engine(prefix_caching: bool) -> LLMEngine:
    return LLMEngine.for_settings(settings_for(
        "embedded:tiny", f"cache.prefix_caching={str(prefix_caching).lower()}", process="inproc", max_num_seqs=4,
        max_num_batched_tokens=64, block_size=BLOCK))


def run(eng: LLMEngine, prompt: list[int], salt: str | None):
    """One request alone (its blocks and checkpoint are written before the next one looks): (tokens and
    logprobs, cached tokens, the run's prefix-cache hit tokens)."""
    item = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, top_logprobs=2)
    out = [u.output for u in eng.stream([item], params, tokens=False)][0]
    assert out.error is None, out.error
    got = (out.token_ids, [(t.token_id, t.logprob, t.top_logprobs) for t in out.logprobs])
    prefix = eng.last_metrics["prefix_cache"]
    return got, out.num_cached_tokens, prefix["hit_tokens"] if prefix else 0


def test_a_salted_request_never_hits_another_tenants_prefix_and_same_salts_share():
    prompt = [random.Random(3).randrange(3, 400) for _ in range(5 * BLOCK + 7)]
    with engine(False) as eng:
        want, cached, _ = run(eng, prompt, None)
    assert cached == 0
    order = [None, None, "tenant-a", "tenant-a", "tenant-b", None, "tenant-a", "tenant-b"]
    with engine(True) as eng:
        runs = [run(eng, prompt, salt) for salt in order]
        summary = eng.last_metrics["prefix_cache"]  # the run summary's figures (the CLI prints them as one line)
        stats = eng.client.core.cache.prefix_stats()
    assert summary["query_tokens"] == len(prompt) and summary["hit_tokens"] == runs[-1][1]
    assert summary["hit_rate"] == summary["hit_tokens"] / summary["query_tokens"]
    assert summary["checkpoint_bytes"] == stats["checkpoint_bytes"] > 0
    assert summary["evicted_blocks"] == stats["evicted_blocks"] and "evicted_checkpoints" in summary
    assert all(got == want for got, _, _ in runs), "an output changed with the cache or the salt"
    cached = [c for _, c, _ in runs]
    hits = [h for _, _, h in runs]
    # first of each tenant: nothing cached (not even the unsalted prefix computed twice before it); later: a hit
    assert cached[0] == cached[2] == cached[4] == 0 and hits[2] == hits[4] == 0, cached
    assert all(cached[i] >= 5 * BLOCK and hits[i] == cached[i] for i in (1, 3, 5, 6, 7)), (cached, hits)


def test_the_salt_is_the_root_of_the_hash_chain():
    assert len({root_key(None), root_key("a"), root_key("b"), root_key("ab")}) == 4
    assert root_key("a") == root_key("a")


@pytest.mark.parametrize("salt", [5, "", "x" * (MAX_CACHE_SALT_CHARS + 1), ["a"]])
def test_a_bad_salt_ends_its_request_alone_with_one_line(salt):
    error = cache_salt_error(salt)
    assert error and "\n" not in error and "cache_salt" in error and str(MAX_CACHE_SALT_CHARS) in error
    assert cache_salt_error("x" * MAX_CACHE_SALT_CHARS) is None and cache_salt_error(None) is None
    # where the core takes a request, in-process and off the wire
    add = m.AddRequest(1, [5, 6], SamplingParams(max_tokens=2), 0, cache_salt=salt)
    assert m.request_error(add) == error
    update = m.from_wire(m.WireRequest(1, [5, 6], {"max_tokens": 2}, 0, [], salt))
    assert isinstance(update, m.RequestUpdate) and update.error == error


def test_the_frontend_refuses_a_bad_salt_and_serves_its_neighbours():
    with engine(True) as eng:
        items = [{"prompt_token_ids": [5, 6, 7], "cache_salt": ""}, {"prompt_token_ids": [5, 6, 7], "cache_salt": "t"}]
        outs = [u.output for u in eng.stream(items, SamplingParams(max_tokens=2, ignore_eos=True), tokens=False)]
    assert outs[0].finish_reason == "error" and "cache_salt" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 2
    wire = m.from_wire(m.to_wire([m.AddRequest(2, [5], SamplingParams(max_tokens=1), 0, cache_salt="t")]).requests[0])
    assert wire.cache_salt == "t"
