"""Prefix caching under the multi-rank layouts, on the CPU with gloo: dep2 (each rank its own engine core and
cache, so a hit is local to the rank a request lands on; a rank with nothing to run joins the step with a dummy
forward) and cp2 (both ranks of the replica run the same scheduler on the same requests, so they make the same
hits and restore the same checkpoint into their own pools, which hold every chunk). A chat served in three rounds
(two requests sending a shared system prompt, one per rank; six requests sending it with their own question;
their second turns, resending the history) gives bitwise the tokens and logprobs of parallel=single with
cache.prefix_caching=false, and the requests after the first round hit.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLM
from deepinfer.sampling import SamplingParams

SEED = 7
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 32}  # 32-token chunks
CACHE = {"block_size": 16, "prefix_checkpoint_interval": 4}


def params(i: int) -> SamplingParams:
    """Greedy and seeded sampling, every other request."""
    if i % 2:
        return SamplingParams(temperature=0.8, top_p=0.95, seq_seed=1000 + i, max_tokens=8, ignore_eos=True,
                              logprobs=True, top_logprobs=2)
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)


def serve(llm: LLM):
    rng = random.Random(11)
    words = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    system = words(70)
    warm = [system + words(3) for _ in range(2)]
    first = [system + words(rng.randint(4, 40)) for _ in range(6)]
    outs = llm.generate(prompt_token_ids=warm, sampling_params=[params(90 + i) for i in range(2)], use_tqdm=False)
    one = llm.generate(prompt_token_ids=first, sampling_params=[params(i) for i in range(6)], use_tqdm=False)
    second = [p + o.token_ids + words(rng.randint(5, 30)) for p, o in zip(first, one)]
    two = llm.generate(prompt_token_ids=second, sampling_params=[params(10 + i) for i in range(6)], use_tqdm=False)
    outs += one + two
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return ([(o.token_ids, [(t.token_id, t.logprob, t.top_logprobs) for t in o.logprobs]) for o in outs],
            [o.num_cached_tokens for o in outs])


@pytest.fixture(scope="module")
def single():
    with LLM("tiny_random", process="inproc", seed=SEED, engine=ENGINE, runtime={"num_threads": 1},
             cache={**CACHE, "prefix_caching": False}) as llm:
        return serve(llm)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dep2", "cp2"])
def test_prefix_hits_under_a_multi_rank_layout_give_the_tokens_and_logprobs_of_single_without_cache(layout, single):
    want, none_cached = single
    with LLM("tiny_random", parallel=layout, seed=SEED, engine=ENGINE, runtime={"num_threads": 1},
             cache=CACHE) as llm:
        assert llm.settings.cache.prefix_caching  # null resolves to on under this layout
        got, cached = serve(llm)
    assert got == want
    assert not any(none_cached)
    assert sum(c >= 64 for c in cached[2:8]) >= 4, cached  # the system prompt, cached on the rank each landed on
    assert sum(c >= 64 for c in cached[8:]) >= 4, cached  # second turns (a hit only where the first turn ran)
