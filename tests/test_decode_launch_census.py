"""The CPU census of a captured decode step's GPU launches (benchmarks/decode_launch_census.py) on the Flash-width
model with one layer of each kind: every op takes the TileLang path, the step's launches do not grow with the
batch once the projections run as GEMMs, the per-step index metadata is cast to int32 once per step rather than
by every layer's launcher, and the JSON carries issue 21's kernels-per-layer target."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")]


def _run_census(tmp_path_factory, *args: str) -> dict:
    """The census script's JSON for `args` on the Flash-width model with one layer of each kind, 1K context."""
    spec = importlib.util.spec_from_file_location("census", ROOT / "benchmarks" / "decode_launch_census.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("census") / "census.json"
    assert mod.main(["--model", "flash_reduced", "--context", "1024", *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    return _run_census(tmp_path_factory, "--batches", "1", "8", "16", "--top", "1000")


# a kernel of every hot op kind of the step, each kind by its builders (the projections: the GEMV at one row, the
# GEMM beyond; RMSNorm: a block or a warp a row, by the width; the mHC mixes: their GEMV at one token, the premix
# beyond)
HOT_KINDS = [{"build_fp8_gemv", "build_fp8_linear"}, {"build_rms_norm_block", "build_rms_norm_warp"}, {"build_rope"},
             {"build_grouped_gemm"}, {"build_mhc_premix", "build_mhc_mixes_gemv"}, {"build_mhc_collapse_norm"},
             {"build_mhc_expand"},
             {"build_sink_attention_decode"}, {"build_router_logits"}, {"build_router_topk"}, {"build_moe_prep"},
             {"build_indexer_scores"}, {"build_index_topk"}, {"build_engram_hash"}, {"build_engram_gate"},
             {"build_compressor_pool"}, {"build_window_kv"}]


def test_the_window_writes_and_the_moe_output_fill_are_no_glue_launches(census):
    """The window KV's ring rows are stored by the kernel that encodes them (window_kv), and the MoE's fp32 output
    is zeroed by the routing table's launch (moe_prep), not by glue."""
    for res in census["batches"].values():
        assert not [s for s in res["glue_sites"] if "_write_window" in s["site"]]
        assert not [s for s in res["glue_sites"] if s["site"].startswith("kernels/tilelang/moe.py")
                    and s["op"] in ("zeros", "zero_", "fill_")]


def test_every_op_of_the_step_takes_the_tilelang_path(census):
    for res in census["batches"].values():
        assert res["torch_fallbacks"] == {}
        builders = set(res["tilelang_by_builder"])
        assert all(kind & builders for kind in HOT_KINDS), [kind for kind in HOT_KINDS if not kind & builders]


def test_the_launches_of_a_step_do_not_grow_with_the_batch(census):
    """The same launches at B=8 and 16 but for the decode attention's combine: a query's 2-8 key splits merge in a
    thread block cluster inside the attention kernel (attention.CLUSTER_SPLITS), more in a combine launch, so a
    batch whose queries take fewer splits may launch fewer kernels, never more."""
    r8, r16 = census["batches"]["8"], census["batches"]["16"]
    combines = [r["tilelang_by_builder"].get("build_sink_combine", 0) for r in (r8, r16)]
    assert combines[1] <= combines[0]
    b8, b16 = r8["step"], r16["step"]
    assert (b8["kernels"] - combines[0], b8["tilelang"] - combines[0], b8["glue"]) == \
        (b16["kernels"] - combines[1], b16["tilelang"] - combines[1], b16["glue"])


def test_no_launcher_casts_the_steps_index_metadata_per_layer(census):
    casts = [site for res in census["batches"].values() for site in res["glue_sites"]
             if site["op"] == "_to_copy" and site["site"].split(":")[0] in (
                 "kernels/tilelang/attention.py", "kernels/tilelang/indexer.py", "kernels/tilelang/topk.py")]
    assert casts == []


def test_the_json_carries_the_kernels_per_layer_target(census):
    assert [t["name"] for t in census["targets"]] == [
        f"decode B={b}: kernels per layer of a step (CPU census)" for b in ("1", "8", "16")]
    assert all(t["target"] == 50 and t["met"] == (t["measured"] <= 50) for t in census["targets"])


@pytest.fixture(scope="module")
def drafting(tmp_path_factory):
    return _run_census(tmp_path_factory, "--batches", "1", "8", "--drafting", "greedy", "sampled", "cut")


def test_a_dspark_step_writes_the_draft_layers_context_through_window_kv(drafting):
    """Every DSpark step writes each draft layer's context key into its ring: norm, rope, FP8 encode and the writes
    as one window_kv launch a layer, no torch encode glue."""
    for res in drafting["batches"].values():
        assert res["tilelang_by_builder"]["build_window_kv"] == res["layers"] + 3  # the trunk's and the drafter's
        assert not [x for x in res["glue_lines"] if "cache_formats.py" in x["site"] or "write_context" in x["site"]]


def test_dspark_drafting_reads_nothing_on_the_host_in_any_mode(drafting):
    """The drafting graph's body for greedy, sampled and top-k/top-p batches ran under registry.no_host_reads (a
    host read raises there, and a captured graph could not hold one): sampled requests can draft by replay. Each
    mode adds only its choice's glue to the same draft-layer kernels, and no mode's launches grow with the batch."""
    drafting = drafting["drafting"]
    assert set(drafting) == {f"{b} {m}" for b in (1, 8) for m in ("greedy", "sampled", "cut")}
    for b in (1, 8):
        steps = [drafting[f"{b} {m}"]["step"] for m in ("greedy", "sampled", "cut")]
        assert steps[0]["tilelang"] == steps[1]["tilelang"] == steps[2]["tilelang"] > 0
        assert steps[0]["glue"] < steps[1]["glue"] < steps[2]["glue"]
        assert all(drafting[f"{b} {m}"]["torch_fallbacks"] == {} for m in ("greedy", "sampled", "cut"))
    for m in ("greedy", "sampled", "cut"):
        assert drafting[f"1 {m}"]["step"]["kernels"] == drafting[f"8 {m}"]["step"]["kernels"]
    # the attention bias of the block's queries is made once a step (DSpark.step), not by each draft layer
    assert not [x for x in drafting["1 greedy"]["glue_lines"] if "dspark.py" in x["site"] and "__call__" in x["site"]
                and {"masked_fill [index]", "zeros [fill]", "ones [fill]"} & set(x["ops"])]


def test_the_census_counts_each_builders_launches_by_their_tokens(drafting):
    """tilelang_rows_by_builder: a launch's leading dim of its first argument (x's tokens for the mixes and the MoE's
    up pass). A plain B=1 step runs them at one token; DSpark's drafting runs the draft layers over the block's five
    positions at once, past the one-token kernels (mhc.GEMV_TOKENS, moe.WARP_STREAM)."""
    plain = drafting["batches"]["1"]["tilelang_rows_by_builder"]
    draft = drafting["drafting"]["1 greedy"]["tilelang_rows_by_builder"]
    assert set(plain["build_mhc_mixes_gemv"]) == {"1"} and "build_mhc_premix" not in plain
    assert set(draft["build_mhc_premix"]) == {"5"}
    launches = drafting["batches"]["1"]["tilelang_by_builder"]["build_mhc_mixes_gemv"]
    assert sum(plain["build_mhc_mixes_gemv"].values()) == launches
    assert "1" in plain["build_fp4_warp_gemm"] and "5" in draft["build_grouped_gemm"]
