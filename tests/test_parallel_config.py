"""The parallel layouts' configuration (issue 13 item 1): conf/parallel/*.yaml, DeepInfer's variables read there,
the resolve step's rules (one-line errors), DeepInfer's LLM sizes mapped onto it, and how rank 0 spreads requests.
No process is started here (tests/test_parallel_engine.py runs the layouts)."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from types import SimpleNamespace

import msgspec
import pytest
from omegaconf import OmegaConf

from deepinfer.api import load_settings
from deepinfer.config import env_vars
from deepinfer.config.compose import group_options
from deepinfer.config.errors import ConfigError
from deepinfer.config.schema import EplbSettings, ParallelSettings
from deepinfer.engine.messages import AddRequest, CoreOutputs, RequestUpdate
from deepinfer.entrypoints.llm import _parallel_overrides
from deepinfer.engine.dp_core import DataParallelCore
from deepinfer.engine.lockstep import Commands
from deepinfer.sampling import SamplingParams

PARALLEL_VARS = ("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE",
                 "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL", "DEEPINFER_GLOO_TIMEOUT")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in PARALLEL_VARS:
        monkeypatch.delenv(name, raising=False)


def one_line_error(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_layouts_and_their_sizes():
    assert group_options("parallel") == ["cp2", "cp4", "dep2", "dep4", "dep8", "single"]
    for name, ranks in (("single", 1), ("dep2", 2), ("dep4", 4), ("dep8", 8)):
        p = load_settings([f"parallel={name}"]).parallel
        assert (p.name, p.data_parallel_size, p.expert_parallel_size, p.context_parallel_size) == (name, ranks, ranks, 1)
        assert p.world_size == ranks and p.eplb == EplbSettings() and p.timeout == 300


def test_dspark_runs_with_expert_parallel():
    s = load_settings(["parallel=dep2", "decoding=dspark"])
    assert (s.parallel.expert_parallel_size, s.decoding.name) == (2, "dspark")


def test_layout_files_fall_back_to_the_schema_defaults():
    schema = ParallelSettings()
    for name in group_options("parallel"):
        node = OmegaConf.create((resources.files("deepinfer.conf") / "parallel" / f"{name}.yaml").read_text())
        if "eplb" in node:  # the ${oc.env:NAME,fallback} reads: their fallbacks are the schema's defaults
            for key in ("redundant_experts", "window", "interval"):
                assert OmegaConf.to_container(node.eplb, resolve=True)[key] == str(getattr(schema.eplb, key)), name
            assert float(OmegaConf.to_container(node, resolve=True)["timeout"]) == schema.timeout


def test_deepinfer_variables_are_read_by_the_layouts_and_named_when_single_ignores_them(monkeypatch):
    monkeypatch.setenv("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "3")
    monkeypatch.setenv("DEEPINFER_EXPERT_COUNT_WINDOW_SIZE", "4")
    monkeypatch.setenv("DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL", "8")
    monkeypatch.setenv("DEEPINFER_GLOO_TIMEOUT", "9.5")
    p = load_settings(["parallel=dep2"]).parallel
    assert (p.eplb.redundant_experts, p.eplb.window, p.eplb.interval, p.timeout) == (3, 4, 8, 9.5)
    assert load_settings(["parallel=dep2", "parallel.eplb.window=2"]).parallel.eplb.window == 2  # CLI > env
    env = {name: "1" for name in PARALLEL_VARS}
    assert [n for n, _ in env_vars.unhonoured(env, world_size=2)] == []
    ignored = env_vars.unhonoured(env, world_size=1)
    assert [n for n, _ in ignored] == sorted(PARALLEL_VARS) and "parallel=single" in ignored[0][1]
    assert load_settings([]).parallel.eplb == EplbSettings()  # single does not read them


@pytest.mark.parametrize("overrides, message", [
    # context parallel runs with EP 1 or EP = CP (within each replica), plain decoding, no YOCO
    # (layout.context_parallel_refusal)
    (["parallel=cp2", "parallel.data_parallel_size=2", "parallel.expert_parallel_size=4"],
     "parallel.expert_parallel_size=4 with parallel.context_parallel_size=2: the experts are either on every rank or "
     "sharded over the context-parallel ranks; allowed: 1 or 2"),
    (["parallel=cp4", "parallel.expert_parallel_size=2"],
     "parallel.expert_parallel_size=2 with parallel.context_parallel_size=4: the experts are either on every rank or "
     "sharded over the context-parallel ranks; allowed: 1 or 4"),
    (["parallel=cp2", "decoding=dspark"], "decoding=dspark with parallel.context_parallel_size=2"),
    (["parallel=cp2", "yoco=mask"], "yoco.mode='mask' with parallel.context_parallel_size=2"),
    (["parallel=dep4", "parallel.expert_parallel_size=3"],
     "parallel.expert_parallel_size=3 does not divide context_parallel_size x data_parallel_size = 1 x 4 = 4 ranks"),
    (["parallel.eplb.redundant_experts=2"], "parallel.eplb.redundant_experts=2 with parallel.expert_parallel_size=1"),
    (["parallel=dep2", "parallel.eplb.interval=8", "parallel.eplb.window=9"],
     "parallel.eplb.window=9 (DEEPINFER_EXPERT_COUNT_WINDOW_SIZE) is out of range with parallel.eplb.interval=8; "
     "allowed: [1, 8]"),
    (["parallel=dep2", "engine.process=inproc"], "engine.process='inproc' with parallel=dep2 (2 ranks)"),
    (["parallel=dep2", "parallel.data_parallel_size=-1"], "parallel.data_parallel_size=-1 is out of range"),
    (["parallel=dep2", "parallel.timeout=0"], "parallel.timeout=0.0 is out of range"),
    (["parallel.timeout=5"], "parallel.timeout=5 with one rank: it has no collective to time out"),
])
def test_layouts_that_cannot_run_are_one_line_errors(overrides, message):
    assert one_line_error(overrides).startswith(message)


def test_context_parallel_runs_with_data_parallel_replicas_and_with_eplb():
    p = load_settings(["parallel=cp2", "parallel.data_parallel_size=2"]).parallel
    assert (p.world_size, p.context_parallel_size, p.data_parallel_size, p.expert_parallel_size) == (4, 2, 2, 2)
    p = load_settings(["parallel=cp2", "parallel.eplb.interval=4", "parallel.eplb.window=4"]).parallel
    assert p.eplb.interval == 4


def test_data_parallel_size_zero_is_expert_over_context_parallel_size():
    p = load_settings(["parallel=dep2", "parallel.data_parallel_size=0", "parallel.expert_parallel_size=4"]).parallel
    assert (p.data_parallel_size, p.world_size) == (4, 4)
    # EP smaller than the world: two groups of 2 ranks, each with every expert
    p = load_settings(["parallel=dep4", "parallel.expert_parallel_size=2"]).parallel
    assert (p.data_parallel_size, p.expert_parallel_size, p.world_size) == (4, 2, 4)


def test_deepinfer_llm_sizes_map_onto_the_layouts():
    assert _parallel_overrides(1, 0, 1, {}) == [] and _parallel_overrides(1, 1, 1, {}) == []
    assert _parallel_overrides(2, 0, 1, {}) == ["parallel=dep2"] == _parallel_overrides(2, 2, 1, {})
    p = load_settings(_parallel_overrides(3, 0, 1, {})).parallel  # no dep3 file: dep2's with the sizes
    assert (p.name, p.data_parallel_size, p.expert_parallel_size, p.world_size) == ("ep3_dp0_cp1", 3, 3, 3)
    p = load_settings(_parallel_overrides(1, 2, 1, {})).parallel  # attention DP only: every rank all experts
    assert (p.data_parallel_size, p.expert_parallel_size) == (2, 1)
    with pytest.raises(ConfigError, match=r"LLM\(context_parallel_size=0\) is not allowed"):
        _parallel_overrides(1, 0, 0, {})
    with pytest.raises(ConfigError, match="one of the two ways"):
        _parallel_overrides(2, 0, 1, {"parallel": "dep4"})


def test_cli_refuses_a_layout_it_cannot_run_in_one_line_with_exit_code_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "deepinfer", "parallel=cp4", "parallel.expert_parallel_size=2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.expert_parallel_size=2 with parallel.context_parallel_size=4" in lines[0]


def _add(rid: int) -> AddRequest:
    return AddRequest(rid, [5, 6], SamplingParams(max_tokens=2), 0)


def test_rank_0_gives_each_request_to_the_rank_with_the_fewest_unfinished():
    sent, aborts = [], []

    def turn(payloads, shutdown=False):  # a stand-in for the three ranks' turn: records what each was sent
        cmds = [msgspec.msgpack.decode(p, type=Commands) if p else Commands() for p in payloads]
        sent.append([[w.request_id for w in c.adds] for c in cmds])
        aborts.append([c.aborts for c in cmds])
        return [CoreOutputs([RequestUpdate(0, [9], finish_reason="stop")] if not len(sent) - 1 else []),
                CoreOutputs([]), CoreOutputs([])]

    core = DataParallelCore(SimpleNamespace(world=SimpleNamespace(size=3, cp_size=1), turn=turn))
    for rid in range(7):
        assert core.add_request(_add(rid)) is None
    out = core.step()
    assert sent[-1] == [[0, 3, 6], [1, 4], [2, 5]]  # round robin from empty ranks, in arrival order
    assert [u.request_id for u in out.updates] == [0]  # request 0 finished on rank 0: it has 2 open, as the others
    core.add_request(_add(7))
    core.add_request(_add(8))
    core.step()
    assert sent[-1] == [[7], [8], []]  # ties go to the lowest rank
    core.abort(4)
    core.abort(99)  # unknown: nothing sent
    core.step()
    assert sent[-1] == [[], [], []] and aborts[-1] == [[], [4], []]  # to the request's rank only


def test_context_parallel_ranks_get_the_same_commands():
    """cp2: the two ranks are one replica: every request and abort goes to both, in the same turn."""
    sent = []

    def turn(payloads, shutdown=False):
        cmds = [msgspec.msgpack.decode(p, type=Commands) if p else Commands() for p in payloads]
        sent.append([([w.request_id for w in c.adds], c.aborts) for c in cmds])
        return [CoreOutputs([]), CoreOutputs([])]

    core = DataParallelCore(SimpleNamespace(world=SimpleNamespace(size=2, cp_size=2), turn=turn))
    for rid in range(3):
        core.add_request(_add(rid))
    core.step()
    assert sent[-1] == [([0, 1, 2], []), ([0, 1, 2], [])]
    core.abort(1)
    core.step()
    assert sent[-1] == [([], [1]), ([], [1])]


def test_the_server_starts_its_engine_on_every_rank_of_the_layout(monkeypatch):
    """serve=openai with a multi-rank layout reaches the engine through the data-parallel client (which starts the
    ranks: tests/test_parallel_engine.py), not one engine core that would refuse to join a world alone."""
    from deepinfer.engine import dp_client
    from deepinfer.serving.server import build_state

    class Started(Exception):
        pass

    def client(factory, options, parallel):
        raise Started(parallel.name, factory.settings.parallel.world_size)

    monkeypatch.setattr(dp_client, "DataParallelClient", client)
    with pytest.raises(Started) as info:
        build_state(load_settings(["parallel=dep4", "serve=openai"]))
    assert info.value.args == ("dep4", 4)


def test_llm_and_the_server_pick_their_client_in_one_place(monkeypatch):
    """make_client serves LLM (LLMEngine.for_settings) as it serves the server: a multi-rank layout gets the
    data-parallel client, one rank the subprocess client, engine.process=inproc the in-process one."""
    from deepinfer.engine import client, dp_client
    from deepinfer.frontend import LLMEngine

    class Started(Exception):
        pass

    def started(kind):
        def make(factory, options, parallel=None):
            raise Started(kind, options.process)
        return make

    monkeypatch.setattr(dp_client, "DataParallelClient", started("dp"))
    monkeypatch.setattr(client, "ProcessClient", started("subprocess"))
    monkeypatch.setattr(client, "InprocClient", started("inproc"))
    for overrides, want in ((["parallel=dep2"], ("dp", "subprocess")), ([], ("subprocess", "subprocess")),
                            (["engine.process=inproc"], ("inproc", "inproc"))):
        with pytest.raises(Started) as info:
            LLMEngine.for_settings(load_settings(overrides))
        assert info.value.args == want
