#!/usr/bin/env python3
"""DSpark speculative decoding through the real engine at a controlled acceptance: per-user speed-up over plain
decoding against the mean accepted length, at batch 1, 8 and 64, on the V4.1-Flash-width synthetic models of
decode_gpu.py (`flash`: 6 layers, `flash40`: the released 40-layer pattern) with V4.1-Flash's three draft layers.

    source benchmarks/gpu_env.sh
    for m in flash flash40; do python3 benchmarks/dspark_gpu.py --model $m --out $OUT/dspark_gpu_${m}_h200.json; done
    # the JSON copied into benchmarks/results/: the docs table and the Pareto PNG from it (no GPU)
    python3 benchmarks/dspark_gpu.py --render benchmarks/results/dspark_gpu_flash_h200.json.xz \\
        benchmarks/results/dspark_gpu_flash40_h200.json.xz --plot benchmarks/results/dspark_gpu_h200.png \\
        --docs docs/dspark.md

Per batch, two engines over the same model (context filled with decode_gpu.py's random valid cache codes, not
prefilled; greedy unless --temperature; CUDA graphs on; --drafts 5 drafts verified per request and step):
  plain    decoding=plain, one token per step.
  j = 0    decoding=dspark, the synthetic draft layers' own guesses (random weights: ~nothing accepted). Its output,
           the target's own greedy continuation (DSpark is lossless), is the reference of the rows below; it runs
           long enough to cover them.
  j >= 1   the same engine (`same_fill`: the same context again), drafts replaced after the drafter ran (the
           runner's draft_override; the drafter's cost stays in the step): the first j are the reference's next
           tokens (accepted), the (j+1)-th a token the target does not pick there (rejected), so every verification
           accepts exactly j drafts: a mean accepted length of 1 + j tokens per step.
  --varlen the planner chooses each step's verification lengths from confidences (1.0 for the first j drafts,
           0.0 after, as a calibrated head's where j pass), over the drafter's own guesses, of which the runner's
           accept_override passes j (the sampler's verification made and paid as always). Controlled drafts need a
           reference run whose steps have the same rows and numerics, which varlen's lengths do not give outside
           the batch-invariant mode: one row takes the FP8 GEMV, more the GEMM, the MoE adds a token's experts with
           fp32 atomics in no fixed order, and a random-weight model turns any rounding difference into another
           token (the H200 runs diverged at the first verification). The j = 0 row verifies nothing.
The fixed-length rows' outputs are checked against the j = 0 run's (DSpark is lossless for the same numerics).
mean accepted length = the engine's own counters over the timed steps (engine.metrics.speculative_summary: 1 +
accepted drafts per verification), not the intended 1 + j. tok/s per user = that / median step time (forward +
verification + drafting, the engine's device interval); speed-up = DSpark tok/s per user over plain's, same batch,
context and run. The `targets` at a mean accepted length of 3.0 take the speed-up linearly interpolated in the
measured length between the two measured rows around 3.0 (the default j = 2 measures it directly).

--profile B:J ... (e.g. 1:plain 1:0 64:2) runs those rows twice more (the row's tokens and half of them), untimed,
and records where a step goes: its drafting (ModelRunner._draft) against the rest (forward and verification), host
clock, medians; and on CUDA the kernels by name per decode step (torch.profiler), the two runs' difference over
their difference in steps (the context fill and prefill cancel out). Under --varlen those sums came out below a
plain step's (B=64, j=2: 1,405 kernels and 105 ms of kernel time for a 129 ms step, seventeenth session): read
them as shares, and take a step's split from benchmarks/dspark_phases.py (its phases between synchronisations).

Exit status 1 when a row did not run as asked (a timed step that did not replay a CUDA graph, for the forward or
for the drafting; a TileLang call falling back to torch; an error; fewer timed steps than asked; a measured mean
accepted length more than --tolerance from 1 + j; a fixed-length row's outputs not the reference's; under --varlen
a verified draft that failed, or a draft verified at j = 0); every row is written first. Exit 2: bad arguments.

Budget (H200, defaults: j in 0 1 2 3 5, 2 + 6 decode steps a row, context 4096): per batch ~110 decode steps of
which ~60 are j=0's (the reference must cover j=5's 6 tokens a step); flash40 at B=64 ~0.25 s a step. Estimated
~2 min for flash (TileLang JIT cold) and ~1.5 min for flash40 (the JIT cache warm from the first), under 4 min.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_gpu import STRICT_KINDS, _fallback_delta, build, make_engine, portable_json  # noqa: E402
from results_io import read_json  # noqa: E402
from target_card import on_card  # noqa: E402

FILLED_NOTE = "decode context filled with random valid cache codes (decode_gpu.py fill), not prefilled"
MODEL_NAMES = {"flash": "6-layer Flash", "flash40": "40-layer Flash", "tiny": "tiny-random"}
KEY_PREFIX = 32  # prompt tokens that name a request's reference (random prompts: checked distinct)
# issue 21's DSpark targets: per-user speed-up at a mean accepted length of 3.0 (B=1, B=64); the step at zero
# acceptance over a plain step (B=1)
LENGTH_AT = 3.0
SPEEDUP_TARGETS = {1: 2.2, 64: 1.5}
ZERO_STEP_TARGET = 1.25


def controlled(j: int, reference: dict, vocab: int):
    """draft_override: the first j drafts the reference's next tokens, the (j+1)-th one it does not have there (so
    greedy verification stops after exactly j), the rest the drafter's own guesses."""
    def override(ids, num_prompt, guesses):
        ref = reference[tuple(ids[:KEY_PREFIX])]
        done = len(ids) - num_prompt
        out = list(guesses)
        for i in range(min(j + 1, len(out))):
            if done + i < len(ref):
                t = ref[done + i]
                out[i] = t if i < j else (t + 1) % vocab
        return out

    return override


def forced(j: int):
    """confidence_override of a varlen row: the first j drafts trusted (1.0), the rest not (0.0), whatever they are:
    a calibrated head's confidences where j drafts pass (the runner's accept_override makes exactly those pass)."""
    def confidences(ids, num_prompt, drafts):
        return [1.0 if i < j else 0.0 for i in range(len(drafts))]

    return confidences


GREEDY = {"temperature": 0.0, "top_p": 1.0}  # the sampling of a run without --temperature / --top-p


def run(engine, tap, prompts, max_tokens: int, warmup: int, steps: int, sampling: dict = GREEDY):
    """One generate of `prompts` with the `sampling` parameters (--temperature / --top-p): (outputs, timed decode
    steps of all rows after `warmup`, fallbacks, seconds)."""
    from deepinfer import SamplingParams
    from deepinfer.kernels.registry import kernel_stats

    t0 = time.time()
    before = kernel_stats()["fallbacks"]
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seq_seed=i, **sampling)
              for i in range(len(prompts))]
    outs = engine.generate(prompts, params, use_tqdm=False)
    fallbacks = _fallback_delta(before, kernel_stats()["fallbacks"])
    decode = [s for s in tap.take() if s.num_prefill_tokens == 0 and s.num_rows == len(prompts)]
    return outs, decode[warmup: warmup + steps], fallbacks, time.time() - t0


def profile_run(engine, tap, prompts, max_tokens: int, warmup: int, steps: int, sampling: dict) -> dict:
    """Two more generates of a row, untimed in the table (the profiler never touches its step times), with
    `max_tokens` and about half of it: each engine step (ModelRunner.execute: forward, verification, drafting; it
    ends on the host with its tokens) and its drafting (ModelRunner._draft, which ends with the drafts on the host)
    timed by the host clock, medians over the longer run's steps; on CUDA the kernels by name per decode step under
    torch.profiler, as the difference of the two runs over their difference in steps, so that what runs once per
    generate (the context fill, the prefill, graph capture) cancels out instead of being spread over the steps.
    Raises when no step or (DSpark) no drafting was seen, or the runs did not differ in steps: a profile that
    measured nothing must not be read as one that measured little."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.client.core.runner
    inner_execute, inner_draft = runner.execute, runner._draft
    cuda = runner.pools.device.type == "cuda"
    dspark = runner.drafter is not None
    runs = []
    for tokens in (max(2, max_tokens // 2), max_tokens):
        spans = {"step": [], "draft": []}

        def timed(name, fn, spans=spans):
            def call(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spans[name].append(time.perf_counter() - t0)
            return call

        runner.execute, runner._draft = timed("step", inner_execute), timed("draft", inner_draft)
        try:
            with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
                run(engine, tap, prompts, tokens, warmup, steps, sampling)
        finally:
            del runner.execute, runner._draft  # the instance attributes: the class's methods again
        if not spans["step"] or (dspark and not spans["draft"]):
            raise RuntimeError(f"dspark_gpu --profile: {len(spans['step'])} steps and {len(spans['draft'])} "
                               "draftings seen: the runner's methods were not the ones called")
        kernels = {}
        if cuda:
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", 0) or 0
                if t > 0 and ev.count:
                    kernels[ev.key] = (t / 1e3, ev.count)
        runs.append((spans, kernels))
    (short, k_short), (spans, k_long) = runs
    n = len(spans["step"]) - len(short["step"])
    if n <= 0:
        raise RuntimeError(f"dspark_gpu --profile: the runs of {max_tokens} and {max(2, max_tokens // 2)} tokens took "
                           f"{len(spans['step'])} and {len(short['step'])} steps: no difference to profile")
    kernels = []
    for key, (ms, count) in k_long.items():
        ms0, count0 = k_short.get(key, (0.0, 0))
        if count > count0:
            kernels.append((key, (ms - ms0) / n, round((count - count0) / n)))
    kernels.sort(key=lambda k: -k[1])
    return dict(steps=n, step_ms=statistics.median(spans["step"]) * 1e3,
                draft_ms=statistics.median(spans["draft"]) * 1e3 if spans["draft"] else 0.0,
                kernels_per_step=sum(c for _, _, c in kernels), kernel_ms_per_step=sum(ms for _, ms, _ in kernels),
                top=[[k, round(ms, 4), c] for k, ms, c in kernels[:30]])


def make_row(model, batch, context, j, outs, timed, fallbacks, seconds, engine, varlen: bool = False) -> dict:
    from deepinfer.engine.metrics import speculative_summary

    dur = [s.device_end - s.device_start for s in timed]
    ms = statistics.median(dur) * 1e3 if dur else float("nan")
    spec = speculative_summary(timed) if j is not None else None
    # varlen steps that verify no drafts are no verifications: one token a step
    length = spec["mean_accepted_length"] if spec else (1.0 if j is None or varlen and timed else float("nan"))
    whole = (engine.last_metrics or {}).get("speculative") if j is not None else None
    return dict(model=model, variant="plain" if j is None else "dspark-varlen" if varlen else "dspark",
                drafts_accepted=j, batch=batch,
                context=context, step_ms=ms, step_ms_min=min(dur) * 1e3 if dur else None,
                mean_accepted_length=length, intended_length=None if j is None else 1 + j,
                acceptance=spec["acceptance_rate"] if spec else None,
                verifications=spec["verifications"] if spec else 0, histogram=spec["histogram"] if spec else None,
                run_mean_accepted_length=whole["mean_accepted_length"] if whole else None,
                tok_s_per_user=length * 1e3 / ms, tok_s_total=batch * length * 1e3 / ms, timed_steps=len(timed),
                graph_steps=sum(s.graph for s in timed), draft_graph_steps=sum(s.draft_graph for s in timed),
                fallbacks=fallbacks, errors=[o.error for o in outs if o.finish_reason == "error"][:3], run_s=seconds)


def diverged(prompts, outs, reference: dict) -> list[int]:
    """Per request, the first output position where it differs from the reference (the j = 0 run's greedy
    output, which DSpark's losslessness makes every later run's), -1 where it does not."""
    out = []
    for p, o in zip(prompts, outs):
        ref, got = reference[tuple(p[:KEY_PREFIX])], list(o.token_ids)
        out.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), -1))
    return out


def check(row, steps: int, on_cuda: bool, tolerance: float, graphs: bool | None = None) -> list[str]:
    """Why this row is not what it claims to be (empty: it is). `graphs`: the run asked for CUDA graphs (default:
    on CUDA)."""
    graphs = on_cuda if graphs is None else graphs
    j = row["drafts_accepted"]
    tag = f"{row['model']} B={row['batch']} " + ("plain" if j is None else f"j={j}")
    bad = []
    if row["errors"]:
        bad.append(f"{tag}: requests ended with errors {row['errors']}")
    lost = [i for i in row.get("diverged") or [] if i >= 0]
    if lost:
        bad.append(f"{tag}: {len(lost)} of {row['batch']} outputs differ from the j=0 run's (DSpark is lossless: "
                   f"the same context must give the same greedy tokens), first at token {min(lost)}")
    if row["timed_steps"] < steps:
        bad.append(f"{tag}: {row['timed_steps']} timed decode steps of {row['batch']} rows, wanted {steps}")
    if graphs and row["graph_steps"] != row["timed_steps"]:
        bad.append(f"{tag}: {row['graph_steps']} of {row['timed_steps']} timed steps replayed a CUDA graph")
    if graphs and j is not None and row["draft_graph_steps"] != row["timed_steps"]:
        bad.append(f"{tag}: drafting replayed a CUDA graph in {row['draft_graph_steps']} of {row['timed_steps']} "
                   f"timed steps")
    strict = {k: v for k, v in row["fallbacks"].items() if k in STRICT_KINDS}
    if on_cuda and strict:
        bad.append(f"{tag}: TileLang calls fell back to torch {strict}")
    if row["variant"] == "dspark-varlen":
        # the planner chooses how many of the j passing drafts to verify (its cost curve decides), never one that
        # fails: a calibrated head puts those at 0
        if not row["mean_accepted_length"] <= 1 + j + tolerance:
            bad.append(f"{tag}: measured mean accepted length {row['mean_accepted_length']:.3f}, at most {1 + j} "
                       "possible")
        if j == 0 and row["verifications"]:
            bad.append(f"{tag}: {row['verifications']} verifications of drafts whose confidence was 0")
        if j and row["verifications"] and row["acceptance"] != 1.0:
            bad.append(f"{tag}: acceptance {row['acceptance']:.3f} of verified drafts, all of which should pass")
    elif j is not None and not abs(row["mean_accepted_length"] - (1 + j)) <= tolerance:
        bad.append(f"{tag}: measured mean accepted length {row['mean_accepted_length']:.3f}, intended {1 + j} "
                   f"(tolerance {tolerance})")
    return bad


def relate(rows: list[dict]) -> None:
    """speedup_vs_plain (tok/s per user) and step_vs_plain (step time) of every DSpark row, from its batch's plain."""
    for r in rows:
        plain = next((p for p in rows if p["variant"] == "plain" and p["batch"] == r["batch"]
                      and p["model"] == r["model"]), None)
        if plain is not None:
            r["speedup_vs_plain"] = r["tok_s_per_user"] / plain["tok_s_per_user"]
            r["step_vs_plain"] = r["step_ms"] / plain["step_ms"]


def interpolate(points, x: float):
    """(y at x, how): linear between the measured (x, y) around x; (None, why) outside them."""
    pts = sorted(points, key=lambda p: p[0])
    for x0, y0, j0 in pts:
        if x0 == x:
            return y0, f"measured at j={j0}"
    for (x0, y0, j0), (x1, y1, j1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            return y, f"linear in the measured length between j={j0} ({x0:.2f}) and j={j1} ({x1:.2f})"
    return None, f"no measured lengths around {x} (measured: {[round(p[0], 2) for p in pts]})"


def targets(rows: list[dict]) -> list[dict]:
    """The JSON's `targets` (issue 21), one per target this run's rows measure, per model."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["variant"] != "plain" and "speedup_vs_plain" in r]
        how_run = " (varlen, calibrated confidences)" if any(r["variant"] == "dspark-varlen" for r in mine) else ""
        for batch, want in SPEEDUP_TARGETS.items():
            pts = [(r["mean_accepted_length"], r["speedup_vs_plain"], r["drafts_accepted"]) for r in mine
                   if r["batch"] == batch and r["mean_accepted_length"] == r["mean_accepted_length"]]
            if pts:
                got, how = interpolate(pts, LENGTH_AT)
                out.append(dict(name=f"{model}: DSpark tok/s per user over plain at a mean accepted length of "
                                     f"{LENGTH_AT}, B={batch}{how_run}",
                                measured=None if got is None else round(got, 3),
                                target=want, unit="x", met=got is not None and got >= want, how=how))
        zero = next((r for r in mine if r["batch"] == 1 and r["drafts_accepted"] == 0), None)
        if zero is not None:
            got = round(zero["step_vs_plain"], 3)
            out.append(dict(name=f"{model}: DSpark step at zero acceptance over a plain step, B=1{how_run}",
                            measured=got,
                            target=ZERO_STEP_TARGET, unit="x", met=got <= ZERO_STEP_TARGET))
    return out


# ---- reading results back: the docs table and the Pareto plot -------------------------------------------------
def load(path: str) -> dict:
    """A result file this script wrote (plain or .xz)."""
    return read_json(path)


def markdown(datas: list[dict]) -> str:
    """The docs table of one or more result files, with their targets."""
    lines = ["| model | batch | drafts accepted | mean accepted length | step ms | tok/s per user | total tok/s "
             "| vs plain per user | step vs plain |", "|---|---|---|---|---|---|---|---|---|"]
    for data in datas:
        for r in sorted(data["rows"], key=lambda r: (r["batch"], -1 if r["drafts_accepted"] is None
                                                      else r["drafts_accepted"])):
            j = r["drafts_accepted"]
            plain = j is None
            lines.append(
                f"| {MODEL_NAMES.get(r['model'], r['model'])} | {r['batch']} | {'plain' if plain else j} | "
                f"{r['mean_accepted_length']:.2f} | {r['step_ms']:.2f} | {r['tok_s_per_user']:.1f} | "
                f"{r['batch'] * r['tok_s_per_user']:.0f} | "
                + ("1.00× | 1.00× |" if plain else "– | – |" if "speedup_vs_plain" not in r  # no plain row
                   else f"{r['speedup_vs_plain']:.2f}× | {r['step_vs_plain']:.2f}× |"))
    lines.append("")
    for data in datas:
        for t in data.get("targets") or []:
            got = "not measured" if t["measured"] is None else f"{t['measured']:.2f}×"
            sign = "≤" if "plain step, B=1" in t["name"] else "≥"
            how = f" ({t['how']})" if t.get("how") else ""
            lines.append(f"- {t['name']}: {got}, target {sign} {t['target']}× — "
                         f"{'met' if t['met'] else 'missed'}{how}")
    return "\n".join(lines)


DOCS_BEGIN = re.compile(r"<!-- dspark_gpu\.py --render (.+?) -->\n")
DOCS_END = "<!-- end of the dspark_gpu.py table -->"


def docs_block(text: str) -> tuple[int, int, list[str]]:
    """(start, end, files) of the generated block in a docs page: between its two marker lines."""
    m = DOCS_BEGIN.search(text)
    end = text.find(DOCS_END, m.end() if m else 0)
    if m is None or end < 0:
        raise SystemExit(f"dspark_gpu: no '<!-- dspark_gpu.py --render FILES -->' ... '{DOCS_END}' block")
    return m.end(), end, m.group(1).split()


def write_docs(page: str, paths: list[str]) -> None:
    text = Path(page).read_text()
    start, end, _ = docs_block(text)
    head = text[:start].rsplit("<!--", 1)[0]
    block = f"<!-- dspark_gpu.py --render {' '.join(paths)} -->\n{markdown([load(p) for p in paths])}\n"
    Path(page).write_text(head + block + text[end:])


def plot(datas: list[dict], path: str) -> bool:
    """Pareto per model: total tok/s vs tok/s per user over the batches, plain and DSpark at each j."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written ({path}); --render the JSON where it is", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(datas), figsize=(7 * len(datas), 5.5), squeeze=False)
    for ax, data in zip(axes[0], datas):
        rows = data["rows"]
        model = rows[0]["model"] if rows else "?"
        for j in sorted({r["drafts_accepted"] for r in rows}, key=lambda j: -1 if j is None else j):
            pts = sorted((r["tok_s_per_user"], r["batch"] * r["tok_s_per_user"], r["batch"],
                          r["mean_accepted_length"]) for r in rows if r["drafts_accepted"] == j)
            label = "plain" if j is None else f"DSpark, {j} accepted (length {statistics.mean(p[3] for p in pts):.2f})"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "ko-" if j is None else "o--", label=label)
            for x, y, b, _ in pts:
                ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # log minor labels overlap
        ax.set_xlabel("tokens/s per user (decode)")
        ax.set_ylabel("total decode tokens/s")
        ctx = rows[0]["context"] if rows else 0
        mode = "CUDA graphs" if data["meta"].get("graphs", True) else "eager"  # the first runs: graphs
        ax.set_title(f"DSpark vs plain, {MODEL_NAMES.get(model, model)}, {data['meta'].get('gpu', '')}\n"
                     f"context {ctx} (filled), {mode}, greedy")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main -----------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/dspark_gpu.json")
    ap.add_argument("--model", choices=tuple(MODEL_NAMES), default="flash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--drafts", type=int, default=5, help="drafts verified per request and step")
    ap.add_argument("--accepted", type=int, nargs="+", default=[0, 1, 2, 3, 5],
                    help="j: drafts accepted per verification (0 runs first: its output is the reference)")
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps per row")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps first (JIT, graph capture)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="measured vs intended mean accepted length")
    ap.add_argument("--plot", default=None, help="Pareto PNG: total tok/s vs tok/s per user")
    ap.add_argument("--render", nargs="+", default=None,
                    help="only read these result files: --plot and --docs from them, the table printed (no GPU)")
    ap.add_argument("--docs", default=None, help="with --render: rewrite this page's generated table block")
    ap.add_argument("--varlen", action="store_true",
                    help="DSpark rows with decoding.varlen, confidences that trust j drafts (`forced`) and the "
                         "runner's accept_override passing them: the planner verifies the drafts that pass")
    ap.add_argument("--temperature", type=float, default=GREEDY["temperature"],
                    help="sampled requests (with --varlen: the fixed-length rows need a greedy reference); their "
                         "drafting replays graphs too (deepinfer.sampling.static_drafts)")
    ap.add_argument("--top-p", type=float, default=GREEDY["top_p"], help="with --temperature: top-p (drafting sorts each row)")
    ap.add_argument("--eager", action="store_true",
                    help="CUDA graphs off (enforce_eager), a diagnosis: the graph checks then do not apply")
    ap.add_argument("--profile", nargs="+", default=[], metavar="B:J",
                    help="rows to profile once more after timing (B:plain or B:j): drafting vs the rest per step, "
                         "and the kernels")
    a = ap.parse_args(argv)
    if a.docs and not a.render:
        ap.error("--docs: needs --render FILES (the table is written from recorded results)")
    if a.drafts < 1:
        ap.error(f"--drafts: {a.drafts}; allowed: 1 or more")
    if 0 not in a.accepted or any(not 0 <= j <= a.drafts for j in a.accepted):
        ap.error(f"--accepted: {a.accepted}; allowed: 0..{a.drafts} (--drafts), 0 included (the reference run)")
    if any(b < 1 for b in a.batches) or a.context < 1 or a.steps < 1 or a.warmup < 0:
        ap.error("--batches, --context, --steps: 1 or more; --warmup: 0 or more")
    if a.temperature < 0 or not 0 < a.top_p <= 1:
        ap.error(f"--temperature {a.temperature}, --top-p {a.top_p}; allowed: temperature >= 0, 0 < top-p <= 1")
    if (a.temperature > 0 or a.top_p < 1) and not a.varlen:
        ap.error("--temperature/--top-p: need --varlen (the fixed-length rows copy a greedy reference's tokens)")
    if a.top_p < 1 and a.temperature == 0:
        ap.error("--top-p: needs --temperature > 0 (greedy requests ignore it)")
    a.accepted = sorted(set(a.accepted))
    cells = set()
    for cell in a.profile:
        b, _, j = cell.partition(":")
        if not (b.isdigit() and int(b) in a.batches and (j == "plain" or j.isdigit() and int(j) in a.accepted)):
            ap.error(f"--profile: {cell!r}; allowed: B:plain or B:j with B in --batches {a.batches} and j in "
                     f"--accepted {a.accepted}")
        cells.add((int(b), None if j == "plain" else int(j)))
    a.profile = cells
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.render:
        datas = [load(p) for p in a.render]
        print(markdown(datas))
        if a.plot and plot(datas, a.plot):
            print("wrote", a.plot)
        if a.docs:
            write_docs(a.docs, a.render)
            print("wrote the table of", a.docs)
        return 0
    from deepinfer.kernels.registry import kernel_stats
    from deepinfer.models import synthetic

    t_start = time.time()
    sampling = dict(temperature=a.temperature, top_p=a.top_p)
    on_cuda = a.device.startswith("cuda")
    graphs = on_cuda and not a.eager
    prefs = {"default": ["tilelang-sm90", "torch"]} if on_cuda else ["torch"]
    model = build(a.model, a.device, prefs, overrides=synthetic.DSPARK_FLASH)
    if getattr(model, "drafter", None) is None:
        raise SystemExit(f"dspark_gpu: model {a.model} has no draft layers")
    vocab = model.config.vocab_size
    print(f"model {a.model} built in {time.time() - t_start:.0f} s (drafter: {model.drafter.num_layers} layers)",
          flush=True)
    meta = dict(gpu=torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu", torch=torch.__version__,
                model=a.model, cmd=" ".join(sys.argv), time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                drafts=a.drafts, accepted=a.accepted, steps=a.steps, warmup=a.warmup, tolerance=a.tolerance,
                varlen=a.varlen, sampling=sampling,
                graphs=graphs, note=FILLED_NOTE)
    rows, failures = [], []
    per_run = a.warmup + a.steps

    def flush():
        relate(rows)
        meta.update(kernels=kernel_stats(), wall_s=time.time() - t_start)
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        Path(a.out).write_text(portable_json(dict(meta=meta, targets=on_card(targets(rows), meta["gpu"]), rows=rows,
                                                   failures=failures)))

    def record(row, profiler):
        if (row["batch"], row["drafts_accepted"]) in a.profile:
            p = row["profile"] = profiler()
            j = row["drafts_accepted"]
            print(f"profile B={row['batch']} {'plain' if j is None else f'j={j}'}: a step {p['step_ms']:.2f} ms "
                  f"(median), its drafting {p['draft_ms']:.2f} ms; {p['kernels_per_step']} kernels, "
                  f"{p['kernel_ms_per_step']:.2f} ms of kernel time a step; top: "
                  + "; ".join(f"{k[:60]} {ms:.3f} ms x{c}" for k, ms, c in p["top"][:12]), flush=True)
        rows.append(row)
        bad = check(row, a.steps, on_cuda, a.tolerance, graphs)
        failures.extend(bad)
        j = row["drafts_accepted"]
        print(f"{a.model} B={row['batch']:<3} {'plain' if j is None else f'j={j}':<6} step {row['step_ms']:8.2f} ms, "
              f"length {row['mean_accepted_length']:.3f}, {row['tok_s_per_user']:8.1f} tok/s/user, "
              f"{row['tok_s_total']:8.0f} tok/s, graphs {row['graph_steps']}/{row['timed_steps']}, "
              f"{row['run_s']:.1f} s" + ("  FAILED: " + "; ".join(bad) if bad else ""), flush=True)
        flush()

    for batch in a.batches:
        g = torch.Generator().manual_seed(batch * 7919 + a.context)
        prompts = torch.randint(3, min(500, vocab), (batch, a.context), generator=g).tolist()
        keys = {tuple(p[:KEY_PREFIX]) for p in prompts}
        if len(keys) != batch:
            raise SystemExit(f"dspark_gpu: two prompts share their first {KEY_PREFIX} tokens; another seed")
        batched = max(batch * (a.context + 1), 8192)
        # plain: one token per step
        engine, tap, _ = make_engine(model, fill=True, max_seqs=batch, context=a.context, max_tokens=per_run + 2,
                                     graphs=graphs, interval=8, batched_tokens=batched, seed=1)
        try:
            outs, timed, fb, s = run(engine, tap, prompts, per_run + 2, a.warmup, a.steps, sampling)
            record(make_row(a.model, batch, a.context, None, outs, timed, fb, s, engine),
                   lambda: profile_run(engine, tap, prompts, per_run + 2, a.warmup, a.steps, sampling))
        finally:
            engine.close()
        # DSpark: j = 0 first (the reference: long enough for the largest j's run), then the same context again
        need = {j: 1 + (j + 1) * per_run + a.drafts + 1 for j in a.accepted}
        # the j = 0 run's length: the reference of the fixed-length rows (varlen's rows need none)
        ref_tokens = need[0] if a.varlen else max(need.values()) + a.drafts + 1
        longest = max(ref_tokens, *need.values())
        engine, tap, _ = make_engine(model, fill=True, max_seqs=batch, context=a.context, max_tokens=longest,
                                     graphs=graphs, interval=8, batched_tokens=batched, num_draft=a.drafts, seed=1,
                                     same_fill=True, varlen=a.varlen)
        try:
            reference = None
            runner = engine.client.core.runner
            for j in a.accepted:
                if a.varlen:
                    # no reference: outside the batch-invariant mode a step's numerics depend on its rows (one row
                    # takes the FP8 GEMV, more the GEMM; the MoE adds a token's experts with fp32 atomics, in no
                    # fixed order), so another run's tokens are no reference for steps of other lengths and rows,
                    # and a random-weight model turns any rounding difference into another token (the H200 runs
                    # diverged at the first verification). The drafter's own guesses are verified, trusted as a
                    # calibrated head trusts j passing drafts, and j of them pass (none verified at j = 0)
                    runner.confidence_override = forced(j)
                    runner.accept_override = (lambda ids, num_prompt, drafts, j=j: j) if j else None
                else:
                    runner.draft_override = None if j == 0 else controlled(j, reference, vocab)
                tokens = ref_tokens if j == 0 else need[j]
                outs, timed, fb, s = run(engine, tap, prompts, tokens, a.warmup, a.steps, sampling)
                if j == 0:
                    reference = {tuple(p[:KEY_PREFIX]): list(o.token_ids) for p, o in zip(prompts, outs)}
                row = make_row(a.model, batch, a.context, j, outs, timed, fb, s, engine, a.varlen)
                if not a.varlen:  # the fixed-length rows against the j = 0 run's output (lossless)
                    row["diverged"] = diverged(prompts, outs, reference)
                record(row, lambda: profile_run(engine, tap, prompts, tokens, a.warmup, a.steps, sampling))
        finally:
            engine.close()
    flush()
    print("wrote", a.out)
    print(markdown([dict(meta=meta, rows=rows, targets=targets(rows))]))
    if a.plot and plot([dict(meta=meta, rows=rows)], a.plot):
        print("wrote", a.plot)
    if failures:
        print("\nFAILED: these rows did not run as asked:\n  " + "\n  ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
