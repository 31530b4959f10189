"""tools/glue_ops.py, the count of torch ops a decode step runs outside the registry's op kinds (each a launch of
its own on the GPU, issue 21 item 2), on the embedded model on the CPU."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import glue_ops  # noqa: E402


@pytest.fixture(scope="module")
def counted():
    from decode_gpu import build

    model = build("tiny", "cpu", None)
    counter = glue_ops.GlueCounter()
    counter.wrap(model.ops)
    with counter:
        return {b: glue_ops.per_step(model, counter, b, context=24, steps=2) for b in (1, 3)}


def test_a_decode_step_calls_the_registry_ops_and_some_glue(counted):
    glue, reg, _ = counted[1]
    assert reg["linear"] > 0 and reg["sink_attention_decode"] > 0 and reg["moe_experts"] > 0
    assert sum(glue.values()) > 0
    # the glue is attributed to the model's source lines, e.g. the window ring's writes
    assert any(line.startswith("deepinfer/models/attention.py:") and name == "index_copy_"
               for (line, name) in glue)


def test_the_launches_of_a_decode_step_do_not_grow_with_the_batch(counted):
    (glue1, reg1, _), (glue3, reg3, _) = counted[1], counted[3]
    assert reg1 == reg3
    assert sum(glue1.values()) == sum(glue3.values())


def test_what_runs_inside_a_registry_op_is_counted_under_its_kind_not_as_glue(counted):
    glue, reg, inside = counted[1]
    kinds = {kind for kind, _ in inside}
    assert kinds <= set(reg) and {"linear", "rms_norm"} <= kinds  # the torch ops of the CPU's op implementations
    assert not {name for (_, name) in inside} & glue_ops.VIEW_OPS


def test_view_ops_are_not_counted(counted):
    glue, _, _ = counted[1]
    assert not {name for (_, name) in glue} & glue_ops.VIEW_OPS
