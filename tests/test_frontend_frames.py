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


def our_frames_from_generate(stack) -> list[str]:
    """Our frames between LLM.generate (included) and the caller of the op, innermost first."""
    names = []
    for info in stack:
        if not _ours(info.filename):
            continue
        names.append(f"{os.path.basename(info.filename)}:{info.function}")
        if info.function == "generate" and info.filename.endswith(os.path.join("deepinfer", "api.py")):
            return names
    raise AssertionError("LLM.generate is not on the stack: " + " < ".join(names))


@pytest.fixture(scope="module")
def llm():
    with LLM(model="tiny", hardware="cpu", process="inproc", runtime={"num_threads": 1},
             engine={"zero_overhead_scheduling": False}) as llm:
        yield llm


def test_llm_generate_reaches_the_first_op_within_twelve_of_our_frames(llm):
    ops = llm.program.model.ops
    seen: list[list[str]] = []
    original = dict(ops._fns)

    def spy(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not seen:
                seen.append(our_frames_from_generate(inspect.stack(0)[1:]))
            return fn(*args, **kwargs)

        return call

    ops._fns.update({kind: spy(fn) for kind, fn in original.items()})
    try:
        out = llm.generate(["def f("], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    finally:
        ops._fns.update(original)
    assert out.finish_reason in ("stop", "length") and seen
    frames = ["<the op>"] + seen[0]  # innermost first; the op's own frame (kernels/) is ours too
    print(f"{len(frames)} of our frames from LLM.generate to the first op:\n  " + "\n  ".join(reversed(frames)))
    assert len(frames) <= LIMIT, " < ".join(reversed(frames))
