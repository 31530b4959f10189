"""benchmarks/dspark_gpu.py on the CPU: the controlled-acceptance run end to end on the embedded tiny model (the
engine's counters say exactly j drafts accepted per verification, which needs the same filled context in every run
and drafts that are the target's own continuation), the run failing when the acceptance is not the intended one, the
targets' interpolation, and the docs table being the render of the recorded results."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("dspark_gpu", ROOT / "benchmarks" / "dspark_gpu.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = ["--model", "tiny", "--device", "cpu", "--context", "64", "--drafts", "3", "--steps", "2", "--warmup", "1"]


def test_controlled_drafts_are_the_reference_then_one_the_target_does_not_pick():
    prompt = list(range(100, 140))
    ref = {tuple(prompt[:bench.KEY_PREFIX]): [7, 8, 9, 10, 11, 12]}
    ids = prompt + [7, 8]  # two tokens generated: the next one is ref[2]
    guesses = [1, 2, 3, 4]
    assert bench.controlled(2, ref, 528)(ids, len(prompt), guesses) == [9, 10, 12, 4]
    assert bench.controlled(0, ref, 528)(ids, len(prompt), guesses) == [10, 2, 3, 4]
    assert bench.controlled(4, ref, 528)(ids, len(prompt), guesses) == [9, 10, 11, 12]
    assert bench.controlled(1, {tuple(prompt[:bench.KEY_PREFIX]): [527] * 3}, 528)(prompt, 40, [5, 5]) == [527, 0]


def _row(**kw):
    row = dict(model="flash40", variant="dspark", drafts_accepted=2, batch=8, errors=[], timed_steps=6,
               graph_steps=6, draft_graph_steps=6, fallbacks={}, mean_accepted_length=3.0)
    return row | kw


def test_check_names_every_way_a_row_is_not_what_it_claims():
    assert bench.check(_row(), 6, True, 0.05) == []
    assert bench.check(_row(mean_accepted_length=2.96), 6, True, 0.05) == []
    (bad,) = bench.check(_row(mean_accepted_length=2.9), 6, True, 0.05)
    assert "mean accepted length 2.900, intended 3" in bad
    assert len(bench.check(_row(mean_accepted_length=float("nan")), 6, True, 0.05)) == 1
    fallbacks = {"moe_experts": {"x": 1}, "rms_norm": {"y": 1}}
    bad = bench.check(_row(graph_steps=5, draft_graph_steps=0, fallbacks=fallbacks), 6, True, 0.05)
    assert len(bad) == 3 and "5 of 6 timed steps replayed" in bad[0] and "drafting" in bad[1]
    assert "moe_experts" in bad[2] and "rms_norm" not in bad[2]
    plain = _row(variant="plain", drafts_accepted=None, draft_graph_steps=0, mean_accepted_length=1.0)
    assert bench.check(plain, 6, True, 0.05) == []
    assert bench.check(_row(graph_steps=0, draft_graph_steps=0), 6, False, 0.05) == []  # CPU: no graphs to ask for
    assert "3 timed decode steps" in bench.check(_row(timed_steps=3, graph_steps=3, draft_graph_steps=3), 6, True,
                                                 0.05)[0]
    # varlen: fewer than j verified is the planner's choice; a verified draft that fails, or a draft verified at
    # confidence 0, is not
    varlen = _row(variant="dspark-varlen", mean_accepted_length=2.0, verifications=6, acceptance=1.0)
    assert bench.check(varlen, 6, True, 0.05) == []
    assert "all of which should pass" in bench.check(varlen | dict(acceptance=0.5), 6, True, 0.05)[0]
    assert "at most 3 possible" in bench.check(varlen | dict(mean_accepted_length=3.5), 6, True, 0.05)[0]
    zero = varlen | dict(drafts_accepted=0, mean_accepted_length=1.0, acceptance=0.0)
    assert "confidence was 0" in bench.check(zero, 6, True, 0.05)[0]


def test_targets_interpolate_the_speedup_in_the_measured_length():
    def rows(batch, plain_ms, points):
        out = [dict(model="flash40", variant="plain", drafts_accepted=None, batch=batch, step_ms=plain_ms,
                    mean_accepted_length=1.0, tok_s_per_user=1e3 / plain_ms)]
        for j, length, ms in points:
            out.append(dict(model="flash40", variant="dspark", drafts_accepted=j, batch=batch, step_ms=ms,
                            mean_accepted_length=length, tok_s_per_user=length * 1e3 / ms))
        return out

    rs = rows(1, 10.0, [(0, 1.0, 12.0), (1, 2.0, 12.0), (3, 4.0, 12.0)]) + rows(64, 50.0, [(2, 3.0, 100.0)])
    bench.relate(rs)
    b1, b64, zero = bench.targets(rs)
    assert b1["name"] == "flash40: DSpark tok/s per user over plain at a mean accepted length of 3.0, B=1"
    # between j=1 (2 tokens in 12 ms) and j=3 (4 in 12 ms): 3 tokens in 12 ms over plain's 1 in 10 ms
    assert b1["measured"] == pytest.approx(2.5) and b1["target"] == 2.2 and b1["met"] and "j=1" in b1["how"]
    assert "B=64" in b64["name"] and b64["measured"] == pytest.approx(1.5) and b64["met"]  # measured at j=2
    assert zero["name"] == "flash40: DSpark step at zero acceptance over a plain step, B=1"
    assert zero["measured"] == pytest.approx(1.2) and zero["met"] and zero["target"] == 1.25 and zero["unit"] == "x"
    rs = rows(1, 10.0, [(0, 1.0, 20.0), (1, 2.0, 20.0)])
    bench.relate(rs)
    b1 = next(t for t in bench.targets(rs) if "B=1" in t["name"] and "length" in t["name"])
    assert b1["measured"] is None and not b1["met"] and "no measured lengths around 3.0" in b1["how"]


def test_the_docs_table_is_the_render_of_the_recorded_results():
    text = (ROOT / "docs" / "dspark.md").read_text()
    start, end, files = bench.docs_block(text)
    assert files and all((ROOT / f).is_file() for f in files)
    assert text[start:end] == bench.markdown([bench.load(str(ROOT / f)) for f in files]) + "\n"


def test_the_recorded_h200_runs_measured_every_row_they_name():
    """Both models' H200 results: every batch has its plain row and j = 0, 1, 2, 3, 5, each at its intended length,
    and one target entry per target of issue 21 with what was measured."""
    for model in ("flash", "flash40"):
        data = bench.load(str(ROOT / "benchmarks" / "results" / f"dspark_gpu_{model}_h200.json.xz"))
        by = {(r["batch"], r["drafts_accepted"]): r for r in data["rows"]}
        assert set(by) == {(b, j) for b in (1, 8, 64) for j in (None, 0, 1, 2, 3, 5)}
        assert all(r["mean_accepted_length"] == pytest.approx(1 + (r["drafts_accepted"] or 0), abs=0.05)
                   for r in data["rows"])
        assert not data["failures"] and len(data["targets"]) == 3
        assert all(t["measured"] is not None and set(t) >= {"name", "measured", "target", "unit", "met"}
                   for t in data["targets"])


def test_bad_arguments_are_named_in_one_line(capsys):
    for argv, field in ((["--accepted", "1", "2"], "--accepted"), (["--accepted", "0", "6"], "--accepted"),
                        (["--drafts", "0"], "--drafts"), (["--docs", "x.md"], "--docs"),
                        (["--profile", "2:2"], "--profile"), (["--profile", "1:4"], "--profile"),
                        (["--temperature", "0.8"], "--temperature"), (["--varlen", "--top-p", "0.9"], "--top-p"),
                        (["--varlen", "--temperature", "-1"], "--temperature")):
        with pytest.raises(SystemExit) as e:
            bench.parse(argv)
        assert e.value.code == 2 and field in capsys.readouterr().err.splitlines()[-1]


def test_a_controlled_run_on_the_cpu_accepts_exactly_j_drafts(tmp_path):
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    rc = bench.main(TINY + ["--batches", "2", "--accepted", "0", "1", "3", "--out", str(out), "--plot", str(png),
                            "--profile", "2:plain", "2:3"])
    data = json.loads(out.read_text())
    assert rc == 0 and data["failures"] == []
    rows = {r["drafts_accepted"]: r for r in data["rows"]}
    assert set(rows) == {None, 0, 1, 3}
    for j in (1, 3):  # every verification of a timed step accepted exactly j drafts: the engine's counters
        assert rows[j]["mean_accepted_length"] == 1 + j and rows[j]["histogram"][j] == rows[j]["verifications"] == 4
    assert rows[0]["mean_accepted_length"] == pytest.approx(1.0, abs=0.05) and rows[None]["mean_accepted_length"] == 1
    assert rows[3]["tok_s_per_user"] == pytest.approx(4e3 / rows[3]["step_ms"])
    assert rows[3]["speedup_vs_plain"] == pytest.approx(rows[3]["tok_s_per_user"] / rows[None]["tok_s_per_user"])
    assert [t["name"] for t in data["targets"]] == []  # no B=1 or B=64 here
    # --profile: the asked rows only, a step split into its drafting and the rest (host clock on the CPU)
    assert [j for j, r in rows.items() if "profile" in r] == [None, 3]
    plain, spec = rows[None]["profile"], rows[3]["profile"]
    assert plain["draft_ms"] == 0 and plain["step_ms"] > 0 and plain["steps"] >= 3
    assert 0 < spec["draft_ms"] < spec["step_ms"]
    if importlib.util.find_spec("matplotlib"):
        assert png.stat().st_size > 0


def test_a_run_whose_acceptance_is_not_the_intended_one_fails(tmp_path, monkeypatch):
    real = bench.controlled
    monkeypatch.setattr(bench, "controlled", lambda j, ref, vocab: real(j - 1, ref, vocab))  # one short
    out = tmp_path / "d.json"
    assert bench.main(TINY + ["--batches", "1", "--accepted", "0", "2", "--out", str(out)]) == 1
    data = json.loads(out.read_text())
    (bad,) = data["failures"]
    assert "j=2: measured mean accepted length 2.000, intended 3" in bad


def test_varlen_confidences_trust_the_first_j_drafts_whatever_they_are():
    assert bench.forced(2)([1, 2], 1, [9, 10, 12, 4]) == [1.0, 1.0, 0.0, 0.0]
    assert bench.forced(0)([1, 2], 1, [9, 10]) == [0.0, 0.0]  # the j = 0 row: nothing verified
    assert bench.forced(3)([1, 2], 1, [9]) == [1.0]


def test_an_accept_override_passes_exactly_the_drafts_it_names_whatever_the_sampler_chose():
    """The runner's accept_override (varlen rows): the verification's tokens as if n drafts passed, then one token
    that is not the next draft (or the bonus token after all of them)."""
    from deepinfer.engine.model_runner import _rigged
    from deepinfer.sampling.logprobs import SampleOutput

    rejected_all = [SampleOutput(9, -1.0, None)]  # the sampler took none of the drafts: its correction 9
    took_all = [SampleOutput(t, -1.0, None) for t in (3, 4, 5, 8)]  # every draft and the bonus 8
    assert [o.token_id for o in _rigged(rejected_all, [3, 4, 5], 2, 100)] == [3, 4, 9]
    assert [o.token_id for o in _rigged(took_all, [3, 4, 5], 1, 100)] == [3, 5]  # 4 would pass: not a rejection
    assert [o.token_id for o in _rigged(took_all, [3, 4, 5], 3, 100)] == [3, 4, 5, 8]
    assert [o.token_id for o in _rigged(rejected_all, [3, 4, 5], 7, 100)] == [3, 4, 5, 9]  # capped at k
    assert [o.token_id for o in _rigged(rejected_all, [9, 4], 0, 100)] == [10]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.9"]], ids=["greedy", "sampled"])
def test_a_varlen_run_on_the_cpu_verifies_exactly_the_drafts_that_pass(tmp_path, monkeypatch, sampling):
    """--varlen: the planner, reading confidences that trust j drafts, verifies those j and no more, and the
    runner's accept_override passes them (every verified draft accepted); at j = 0 none (one token a step, no
    verification); sampled requests alike. The planner prices steps by a given cost curve (a verified token costs a
    little, as on a GPU at batch 1), not by this machine's clock."""
    from deepinfer.engine import spec_schedule

    curve = spec_schedule.CostCurve([(1, 10.0), (2, 10.2), (4, 10.4), (8, 10.8)])
    monkeypatch.setattr(spec_schedule, "load_or_profile_cost_curve", lambda *args: curve)
    monkeypatch.setattr(spec_schedule.VarlenPlanner, "update_runtime", lambda *args, **kw: None)
    out = tmp_path / "v.json"
    rc = bench.main(TINY + ["--batches", "1", "--accepted", "0", "2", "--varlen", "--out", str(out)] + sampling)
    data = json.loads(out.read_text())
    assert rc == 0 and data["failures"] == [] and data["meta"]["varlen"] is True
    assert data["meta"]["sampling"] == {"temperature": 0.8 if sampling else 0.0, "top_p": 0.9 if sampling else 1.0}
    rows = {r["drafts_accepted"]: r for r in data["rows"]}
    assert rows[0]["variant"] == "dspark-varlen" and rows[0]["verifications"] == 0
    assert rows[0]["mean_accepted_length"] == 1.0
    assert rows[2]["mean_accepted_length"] == 3.0 and rows[2]["acceptance"] == 1.0
    assert rows[2]["verifications"] == rows[2]["timed_steps"]
    zero = next(t for t in data["targets"] if "zero acceptance" in t["name"])
    assert zero["name"].endswith("(varlen, calibrated confidences)")


def test_the_phase_split_times_the_sampled_requests_own_parts(monkeypatch, capsys):
    """benchmarks/dspark_phases.py --temperature: beside the step's phases, the processed weights and acceptance
    tests of a sampled verification and (with drafting graphs, on a GPU) the fill and hand-over; on the CPU the
    drafting is eager, so those two do not appear."""
    spec = importlib.util.spec_from_file_location("dspark_phases", ROOT / "benchmarks" / "dspark_phases.py")
    phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phases)
    monkeypatch.setattr(sys, "argv", ["dspark_phases.py", "tiny", "1", "2", "--context", "128", "--temperature", "0.8",
                                      "--top-p", "0.9"])
    assert phases.main() == 0
    out = capsys.readouterr().out
    assert "tiny B=1 j=2 sampled" in out and "fallbacks none" in out
    for phase in ("sampler.verify", "the target's processed weights", "accept_sampled_rows", "_draft"):
        line = next(ln for ln in out.splitlines() if phase in ln)
        assert int(line.split("calls")[1].split()[0]) > 0, line
