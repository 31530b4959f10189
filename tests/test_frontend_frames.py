"""How deep the stack is from LLM.generate to the model's first op, with the in-process engine core on the embedded
CPU model: issue 23's "one frontend" target is at most 12 of our frames (files under deepinfer/ or kernels/)."""

import functools
import inspect
import os

import pytest

from deepinfer import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = tuple(os.path.realpath(os.path.join(ROOT, d)) + os.sep for d in ("deepinfer", "kernels"))
LIMIT = 12


def _ours(filename: str) -> bool:
    return os.path.realpath(filename).startswith(OURS)


def our_frames(stack) -> list[str]:
    """Our frames on the stack, innermost first (the test's own frames and pytest's are not ours)."""
    return [f"{os.path.basename(i.filename)}:{i.function}" for i in stack if _ours(i.filename)]


@pytest.fixture(scope="module")
def llm():
    with LLM(model="tiny", hardware="cpu", process="inproc", runtime={"num_threads": 1},
             engine={"zero_overhead_scheduling": False}) as llm:
        yield llm


def run_generate(llm, sp):
    return llm.generate(["def f("], sp, use_tqdm=False)[0]


def run_generate_iter(llm, sp):
    return [u.output for u in llm.generate_iter(["def f("], sp) if u.output is not None][0]


@pytest.mark.parametrize("run, outermost", [(run_generate, "api.py:generate"),
                                            (run_generate_iter, "api.py:_holding")])
def test_the_first_op_is_within_twelve_of_our_frames_in_the_callers_thread(llm, run, outermost):
    ops = llm._engine.client.core.runner.backend.model.ops  # the core's model: the frontend holds no weights
    seen: list[list[str]] = []
    original = dict(ops._fns)

    def spy(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not seen:
                seen.append(our_frames(inspect.stack(0)[1:]))
            return fn(*args, **kwargs)

        return call

    ops._fns.update({kind: spy(fn) for kind, fn in original.items()})
    try:
        out = run(llm, SamplingParams(temperature=0, max_tokens=2))
    finally:
        ops._fns.update(original)
    assert out.finish_reason in ("stop", "length") and seen
    frames = ["<the op>"] + seen[0]  # innermost first; the op's own frame (kernels/) is ours too
    print(f"{len(frames)} of our frames from {outermost} to the first op:\n  " + "\n  ".join(reversed(frames)))
    assert frames[-1] == outermost, "the op did not run under the caller's frame (another thread?)"
    assert len(frames) <= LIMIT, " < ".join(reversed(frames))
