"""benchmarks/decode_gpu.py on the CPU: its fill backend leaves the cache pools as a real prefill would (same rows,
valid codes, same token counts), the engine runs it end to end on the embedded tiny model and writes its rows, and
its roofline arithmetic is roofline.py's (checked against a recorded layer-benchmark figure)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("decode_gpu", ROOT / "benchmarks" / "decode_gpu.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["decode_gpu"] = bench
spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def tiny():
    from deepinfer.embedded import materialize
    from deepinfer.models import load_model

    return load_model(materialize("tiny-random"), device="cpu", dtype=torch.float32)


def _pools(model):
    from deepinfer.models.cache import SequenceCache

    pools = model.allocate_cache(num_slots=2, num_blocks=6, block_size=64)
    return pools, SequenceCache(pools, 1, [4, 2])  # slot 1, blocks out of order: addressing is the metadata's


def _written_rows(t):
    return t.reshape(t.shape[0], -1).ne(0).any(-1)[:-1]  # the trash row (last) is never read: not compared


def test_fill_writes_the_rows_a_real_prefill_writes_with_valid_codes(tiny):
    from deepinfer.models import ForwardBatch

    ids = torch.randint(3, 500, (75,), generator=torch.Generator().manual_seed(0)).tolist()  # odd: an open group
    real_pools, real = _pools(tiny)
    fill_pools, filled = _pools(tiny)
    tiny.forward(ForwardBatch([ids], [real]))
    logits = bench.fill_step(tiny, ForwardBatch([ids], [filled]), torch.Generator().manual_seed(1), chunk=32)
    assert logits.shape == (1, tiny.config.vocab_size) and logits.dtype == torch.float32
    assert filled.num_tokens == real.num_tokens == 75
    assert torch.equal(fill_pools.win_pos[:-1], real_pools.win_pos[:-1])  # the last row is the trash row
    assert torch.equal(fill_pools.ngram[:-1], real_pools.ngram[:-1])
    pairs = [(a, b) for la, lb in zip(fill_pools.window, real_pools.window) for a, b in zip(la, lb)]
    for d_fill, d_real in ((fill_pools.compressed, real_pools.compressed), (fill_pools.index_keys, real_pools.index_keys)):
        pairs += [(a, b) for s in d_real for a, b in zip(d_fill[s], d_real[s])]
    pairs += [(fill_pools.open_groups[s], real_pools.open_groups[s]) for s in real_pools.open_groups]
    assert pairs
    for a, b in pairs:
        assert torch.equal(_written_rows(a), _written_rows(b))
    for parts in fill_pools.window:  # FP8 codes: never the NaN patterns 0x7F / 0xFF
        if parts[0].dtype == torch.uint8:
            assert not ((parts[0] & 0x7F) == 0x7F).any()


def test_the_fill_starts_after_the_engine_so_varlen_prices_real_forwards(tiny, monkeypatch):
    """The varlen planner profiles its cost curve while the engine starts, through the backend's prefill: those
    steps run the model; only the requests' prefills are filled."""
    from deepinfer import SamplingParams
    from deepinfer.engine import spec_schedule

    fills, profiled, fill = [], [], bench.fill_step
    monkeypatch.setattr(bench, "fill_step", lambda *args, **kwargs: fills.append(1) or fill(*args, **kwargs))

    def profile(cache_dir, key, ttl, run_tokens, sizes, **kwargs):
        for n in sizes:
            run_tokens(n)
            profiled.append(n)
        return spec_schedule.CostCurve([(n, 1.0) for n in sizes])

    monkeypatch.setattr(spec_schedule, "load_or_profile_cost_curve", profile)
    engine, _, _ = bench.make_engine(tiny, fill=True, max_seqs=2, context=16, max_tokens=4, graphs=False,
                                     interval=8, batched_tokens=64, num_draft=2, varlen=True)
    try:
        assert profiled and not fills  # the start-up profile ran forwards, none of them a fill
        engine.generate([[5] * 16], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
        assert fills  # a request's prefill is filled
    finally:
        engine.close()


def test_engine_with_the_fill_backend_times_decode_steps_and_writes_rows(tmp_path):
    out = tmp_path / "decode.json"
    rc = bench.main(["--model", "tiny", "--device", "cpu", "--batches", "2", "--contexts", "64", "--steps", "3",
                     "--warmup", "0", "--variants", "eager", "--prefill", "64", "--chunk", "32", "--routing",
                     "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["failures"] == [] and "not prefilled" in data["meta"]["note"]
    (pre,) = [r for r in data["rows"] if r["mode"] == "prefill"]
    assert pre["steps"] == 2 and pre["tokens"] == 64 and pre["tok_s"] > 0  # 64 tokens in chunks of 32
    (dec,) = [r for r in data["rows"] if r["mode"] == "decode"]
    assert (dec["batch"], dec["context"], dec["timed_steps"], dec["graph_steps_timed"]) == (2, 64, 3, 0)
    assert dec["context_source"] == "filled" and not dec["errors"]
    assert dec["step_ms"] > 0 and dec["tok_s_per_user"] == pytest.approx(dec["tok_s"] / 2)
    assert dec["pct_roofline"] == pytest.approx(dec["floor"]["floor_ms"] / dec["step_ms"] * 100)
    routed = dec["routed"]  # --routing: the experts one decode step of 2 rows touched, the floor at them
    assert 2 <= routed["experts_measured"] <= 4 and routed["moe_calls"] == 8  # top-2 of 8, each of the 8 layers
    assert routed["experts_uniform"] == pytest.approx(8 * (1 - (6 / 8) ** 2))  # roofline.py's count, 3.5
    more = routed["experts_measured"] - routed["experts_uniform"]  # the floor moves with the experts touched:
    per_expert = 3 * 128 * 64 * (0.5 + 1 / 32)  # gate, up and down of hidden 128 x 64, FP4 (roofline.py's bytes)
    assert routed["bytes"] - dec["floor"]["bytes"] == pytest.approx(8 * more * per_expert, abs=1e-3)
    assert routed["pct_roofline"] == pytest.approx(routed["floor_ms"] / dec["step_ms"] * 100)


def test_profiled_cells_are_profiled_after_every_cell_is_timed(tmp_path, monkeypatch):
    """torch.profiler leaves CUPTI attached, and steps timed after a profile ran slower (B=8 on the H200: 20.51 ms
    right after B=1's profile, 18.79 without): the profiles run once every cell of every context is timed, each
    attached to its own row."""
    order = []
    real_run = bench.run_decode

    def run_decode(engine, tap, batch, context, *args, **kw):
        order.append(("timed", batch, context))
        return real_run(engine, tap, batch, context, *args, **kw)

    def profile_decode(engine, tap, batch, context, vocab, steps=4):
        order.append(("profile", batch, context))
        return dict(decode_steps=steps, timed_steps=steps + 1, kernels=7, cuda_ms=1.0, router_calls=_tiny_layers(),
                    top=[("k", 1.0, 7)])

    monkeypatch.setattr(bench, "run_decode", run_decode)
    monkeypatch.setattr(bench, "profile_decode", profile_decode)
    out = tmp_path / "decode.json"
    rc = bench.main(["--model", "tiny", "--device", "cpu", "--batches", "1", "2", "--contexts", "32", "64", "--steps",
                     "2", "--warmup", "0", "--variants", "eager", "--prefill", "--profile", "1:32,2:64", "--out",
                     str(out)])
    assert rc == 0
    timed = [i for i, (kind, *_) in enumerate(order) if kind == "timed"]
    profiles = [i for i, (kind, *_) in enumerate(order) if kind == "profile"]
    assert len(timed) == 4 and [order[i][1:] for i in profiles] == [(1, 32), (2, 64)]
    assert max(timed) < min(profiles)
    rows = {(r["batch"], r["context"]): r for r in json.loads(out.read_text())["rows"] if r["mode"] == "decode"}
    assert {k for k, r in rows.items() if "profile" in r} == {(1, 32), (2, 64)}
    assert rows[(1, 32)]["profile"]["kernels"] == 7 and rows[(1, 32)]["profile"]["layers"] > 0


def _tiny_layers() -> int:
    from deepinfer.embedded import materialize

    config = json.loads((Path(materialize("tiny-random")) / "config.json").read_text())
    return config.get("text_config", config)["num_hidden_layers"]


def test_a_profile_that_did_not_cover_whole_steps_fails_the_run(tmp_path, monkeypatch):
    """Every profile of the sessions before the fortieth saw the router 30 times a step of 40 layers: the first run
    of a batch on the profile engine held its graph capture's warm-up forward, so the difference of two runs covered
    3 of its 4 steps. The router runs once a layer, so a profile whose count says otherwise fails the run, and its
    kernels-per-layer figure is not reported as a target."""
    def profile_decode(engine, tap, batch, context, vocab, steps=4):
        layers = _tiny_layers()
        return dict(decode_steps=steps, timed_steps=steps + 1, kernels=7 * layers, cuda_ms=1.0,
                    router_calls=layers * 3 / 4, top=[("router_logits_kernel", 1.0, layers * 3 / 4)])

    monkeypatch.setattr(bench, "profile_decode", profile_decode)
    out = tmp_path / "decode.json"
    rc = bench.main(["--model", "tiny", "--device", "cpu", "--batches", "1", "--contexts", "32", "--steps", "2",
                     "--warmup", "0", "--variants", "eager", "--profile", "1:32", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 1 and any("did not cover whole steps" in f for f in data["failures"])
    assert not any("kernels per layer" in t["name"] for t in data["targets"])


def test_the_profile_runs_the_batch_once_unprofiled_first(monkeypatch):
    """The graph capture of a batch's first step (an extra eager forward) falls outside both profiled runs."""
    calls = []

    def run_decode(engine, tap, batch, context, warmup, steps, vocab, seed=0):
        calls.append((steps, seed))
        return [object()] * steps, [], {}, {}, []

    class NoProfiler:  # the CPU has no CUDA activity to record: an empty profile
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return []

    monkeypatch.setattr(bench, "run_decode", run_decode)
    monkeypatch.setattr(torch.profiler, "profile", NoProfiler)
    prof = bench.profile_decode(None, None, 1, 32, 100)
    assert [s for s, _ in calls] == [1, 1, 1 + bench.PROFILE_STEPS] and prof["router_calls"] == 0


def test_check_decode_names_a_graph_run_without_graphs():
    row = dict(variant="graphs", backend="tilelang", graphs=True, batch=8, context=4096, errors=[], timed_steps=4,
               graph_steps_timed=0, graph_steps=0,
               fallbacks={"moe_experts": {"x": 3}, "engram_gate": {"y": 1}, "rms_norm": {"z": 2}})
    bad = bench.check_decode(row, 4)
    assert len(bad) == 2 and "ran eagerly" in bad[0] and "moe_experts" in bad[1] and "engram_gate" in bad[1]
    assert "rms_norm" not in bad[1]  # not a strict kind


def test_roofline_copy_is_the_shared_tool_verbatim():
    shared = ROOT.parent / "shared" / "tools" / "roofline.py"
    if not shared.is_file():
        pytest.skip("shared/tools/roofline.py is not beside this checkout")
    copy = [l for l in (ROOT / "benchmarks" / "roofline.py").read_text().splitlines() if not l.startswith("# Verbatim")]
    assert copy == shared.read_text().splitlines()


def test_roofline_arithmetic_matches_the_recorded_layer_figures():
    """docs/hopper-kernels.md's layer table (H200, 4.27 TB/s, 791 TFLOP/s): the Flash-width six layers' mean floor
    is 0.074 ms at B=1, 4K and 1.125 ms at B=64, 4K; the whole step adds the lm head (129280 x 5120 bf16) to the
    bytes."""
    from deepinfer.models import synthetic

    roofline = bench.load_roofline()
    c = bench.roofline_config(roofline, synthetic.config())
    bw, peak = 4.27e12, 791e12
    for batch, want in ((1, 0.074), (64, 1.125)):
        per_layer = [roofline.layer_floor(c, i, batch, 4096) for i in range(6)]
        mean_ms = sum(max(b / bw, f / peak) for b, f in per_layer) / 6 * 1e3
        assert round(mean_ms, 3) == want
    step = bench.step_roofline(roofline, c, bw, peak, 1, 4096)
    layers_bytes = sum(roofline.layer_floor(c, i, 1, 4096)[0] for i in range(6))
    assert step["bytes"] == pytest.approx(layers_bytes + 129280 * 5120 * 2)
    assert step["floor_ms"] == pytest.approx(max(step["bytes"] / bw, step["flops"] / peak) * 1e3)
    assert math.isclose(step["floor_ms"], step["bw_ms"])  # batch 1 decode is bandwidth-bound


def test_targets_are_written_from_the_measured_rows():
    rows = [dict(mode="prefill", tokens=8192, pct_compute_roofline=41.0),
            dict(mode="prefill", tokens=4096, pct_compute_roofline=1.0),  # no target at 4K
            dict(mode="decode", variant="graphs", batch=64, context=4096, pct_roofline=64.9),
            dict(mode="decode", variant="graphs", batch=1, context=32768, pct_roofline=40.0,
                 profile=dict(kernels=1980, layers=40)),  # a profiled B=1 row: the launch target too
            dict(mode="decode", variant="eager", batch=64, context=4096, pct_roofline=99.0)]  # graphs rows only
    got = {t["name"]: (t["measured"], t["target"], t["met"]) for t in bench.targets(rows)}
    assert got == {"prefill of 8192 tokens, % of the compute roofline": (41.0, 40.0, True),
                   "decode B=64 ctx=4096, % of the step roofline": (64.9, 65.0, False),
                   "decode B=1 ctx=32768, % of the step roofline": (40.0, 40.0, True),
                   "decode B=1 ctx=32768, kernels per layer of a step": (49.5, 50, True)}


def test_the_batch_invariance_cost_compares_an_off_and_an_on_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bi_cost", ROOT / "benchmarks" / "batch_invariance_cost_gpu.py")
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)

    def run(name, invariant, step_ms, prefill_s):
        rows = [dict(mode="decode", variant="graphs", batch=64, context=4096, step_ms=step_ms),
                dict(mode="prefill", tokens=8192, prefill_s=prefill_s)]
        (tmp_path / name).write_text(json.dumps(dict(meta=dict(model="flash", batch_invariant=invariant), rows=rows)))
        return str(tmp_path / name)

    out = cost.compare(run("off.json", False, 10.0, 1.0), run("on.json", True, 11.6, 1.1))
    assert [(t["measured"], t["met"]) for t in out["targets"]] == [(16.0, False), (10.0, True)]
    with pytest.raises(SystemExit, match="--off must be a run without"):
        cost.compare(run("a.json", True, 1.0, 1.0), run("b.json", True, 1.0, 1.0))


def _recorded(path, model, rows):
    path.write_text(json.dumps({"meta": {"model": model}, "rows": rows}))
    return str(path)


def _decode_row(batch, ctx, tok_s):
    return {"mode": "decode", "variant": "graphs", "batch": batch, "context": ctx, "tok_s": tok_s,
            "tok_s_per_user": tok_s / batch}


def test_the_pareto_plot_is_drawn_from_recorded_runs_the_later_file_winning_a_cell(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(bench, "plot", lambda rows, path, model: drawn.update(rows=rows, path=path, model=model))
    old = _recorded(tmp_path / "a.json", "flash40", [_decode_row(1, 4096, 50), _decode_row(8, 4096, 200)])
    new = _recorded(tmp_path / "b.json", "flash40", [_decode_row(8, 4096, 350), {"mode": "prefill"}])
    assert bench.main(["--plot", str(tmp_path / "p.png"), "--plot-from", old, new]) == 0
    assert drawn["model"] == "flash40" and drawn["path"] == str(tmp_path / "p.png")
    assert sorted((r["batch"], r["tok_s"]) for r in drawn["rows"]) == [(1, 50), (8, 350)]


def test_the_pareto_plot_refuses_runs_of_different_models_and_needs_a_path(tmp_path):
    a = _recorded(tmp_path / "a.json", "flash", [_decode_row(1, 4096, 50)])
    b = _recorded(tmp_path / "b.json", "flash40", [_decode_row(1, 4096, 50)])
    assert bench.main(["--plot", str(tmp_path / "p.png"), "--plot-from", a, b]) == 2
    assert bench.main(["--plot-from", a]) == 2
    assert not (tmp_path / "p.png").exists()


def test_results_name_the_machines_paths_by_their_variables(monkeypatch, tmp_path):
    """A result file written on the device carries $OUT, $DEEPINFER_JIT_MANIFEST and $TILELANG_CACHE_DIR, never the
    machine's own paths."""
    out, manifest, cache = tmp_path / "out", tmp_path / "jit.jsonl", tmp_path / "tilelang-cache"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("DEEPINFER_JIT_MANIFEST", str(manifest))
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    monkeypatch.delenv("DEEPINFER_JIT_CACHE_DIR", raising=False)
    text = bench.portable_json({"manifest": str(manifest), "cache_dir": str(cache),
                                "out": str(out / "decode.json"), "src": str(ROOT / "benchmarks" / "decode_gpu.py")})
    assert json.loads(text) == {"manifest": "$DEEPINFER_JIT_MANIFEST", "cache_dir": "$TILELANG_CACHE_DIR",
                                "out": "$OUT/decode.json", "src": "benchmarks/decode_gpu.py"}
