"""One LLM under threads (issue 25 item 1): calls from several threads are served one after the other (a frontend
lock), each gets its own complete outputs, and nothing crashes; an LLM built in a thread that then exits keeps its
engine core (the core follows its parent process, not the thread that started it)."""

import threading

import pytest

from deepinfer import LLM, SamplingParams
from model_fixtures import FIXTURES

PROMPTS = [[[5, 17, 33], [9, 2]], [[40, 41, 42, 43], [7]]]  # the two threads' prompt lists
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(model=str(FIXTURES / "tiny-swa-csa2"), runtime={"num_threads": 1}) as llm:  # a subprocess core
        yield llm


def _tokens(outs):
    return [o.token_ids for o in outs]


def test_generate_from_two_threads_at_once_returns_each_threads_own_outputs(llm):
    want = [_tokens(llm.generate(prompt_token_ids=p, sampling_params=GREEDY, use_tqdm=False)) for p in PROMPTS]
    got, errors = [None, None], []
    start = threading.Barrier(2)

    def call(i):
        try:
            start.wait()
            got[i] = _tokens(llm.generate(prompt_token_ids=PROMPTS[i], sampling_params=GREEDY, use_tqdm=False))
        except BaseException as exc:  # reported below: a thread's exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == want


def test_an_open_iterator_holds_the_llm_until_it_is_closed(llm):
    it = llm.generate_iter(prompt_token_ids=PROMPTS[0], sampling_params=GREEDY)
    next(it)  # the iterator now holds the LLM

    def can_enter() -> bool:  # from another thread: would a call get in now?
        box = []

        def probe():
            took = llm._lock.acquire(blocking=False)
            if took:
                llm._lock.release()
            box.append(took)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return box[0]

    assert not can_enter()
    it.close()  # aborts the iterator's requests and lets other threads in
    assert can_enter()
    assert _tokens(llm.generate(prompt_token_ids=PROMPTS[1], sampling_params=GREEDY, use_tqdm=False))


def test_an_llm_built_in_a_thread_that_exits_keeps_its_engine():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("llm", LLM(model=str(FIXTURES / "tiny-swa-csa2"),
                                                                   runtime={"num_threads": 1})))
    t.start()
    t.join()
    with box["llm"] as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS[0], sampling_params=GREEDY, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 6] and all(o.error is None for o in outs)
