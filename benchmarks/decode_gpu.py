#!/usr/bin/env python3
"""The real engine (LLMEngine: scheduler, cache manager, model runner, sampler, async scheduling) on a
V4.1-Flash-width synthetic model of reduced depth: decode step time, tokens/s and % of the whole step's roofline at
batch x context, CUDA graphs on vs off, the torch-op backend in the same run; prefill tokens/s and % of the compute
roofline; the device's idle time between steps; a Pareto plot (total tok/s vs tok/s per user).

    source benchmarks/gpu_env.sh
    python3 benchmarks/decode_gpu.py --out $OUT/decode_gpu.json --plot $OUT/decode_gpu.png [--quick]

Model (--model): `flash` = deepinfer.models.synthetic.FLASH_REDUCED (hidden 5120, 64 heads x 512, 384 FP4 experts
top-6, window 128, index top-512; six layers, one of each kind); `flash40` = FLASH_FULL, the released 40-layer
pattern whose layers of one kind share weights by reference (every layer its own caches: the released model's bytes
and FLOPs per step, roofline.py's released-model floor). Random weights in the released formats, bf16, TileLang SM90
kernels preferred (the `torch` variant: the same model on an OpSet of torch ops only, eager).

DECODE CONTEXT IS FILLED, NOT PREFILLED. Prefilling 256 x 32K tokens with the real model would take minutes of
device time, so the decode rows run on a benchmark backend (FillBackend) whose *prefill* stage writes random valid
cache contents (FP8 e4m3 / FP4 e2m1 codes encoded by the pools' own codecs from unit-variance values, so no NaN
pattern and sane scales) at exactly the rows the step metadata names (window rings + their positions, compressed
KV and indexer-key entries, open compression groups, Engram history) and advances each sequence's token count;
its *decode* stage is the real model (`model.forward`; the runner may replay CUDA graphs). All B requests are
submitted at once with max_num_batched_tokens >= B x context, so every fill happens in the first step and only
decode-only steps of B rows are timed. The attention work of a decode step depends on the context length and the
pool layout, not on the cached values, so the timing is that of a prefilled context.

PREFILL is measured separately with the real model: one request of 8K and of 32K tokens, max_num_batched_tokens
--chunk (8192: the 32K prompt runs as 4 chunks), tokens over the device time of its prefill steps.

Timing: the engine's own per-step device interval (StepStats.device_start/end: host perf_counter around forward +
sample, which on CUDA ends when the sampled tokens are read back), medians over the timed steps. `gap` = device
idle time between consecutive timed steps (the next step's start minus the previous end, engine clock).
Roofline: bytes and FLOPs of the whole step (all layers + lm head) from benchmarks/roofline.py (verbatim copy of
shared/tools/roofline.py) for this model's config, over the copy bandwidth and bf16 GEMM rate measured at the
start of the run: floor = max(bytes / BW, FLOPs / peak); % of roofline = floor / median step time.

Exit status: non-zero when any variant did not run as asked (graphs requested but a timed step did not replay one,
graphs off but one did, a TileLang run whose attention / MoE / linear / indexer / top-k / compressor / Engram calls
fell back to torch, a step that errored); every row is still written first.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from results_io import open_result, read_json  # noqa: E402
from target_card import on_card  # noqa: E402

FILLED_NOTE = "decode context filled with random valid cache codes (FillBackend), not prefilled by the model"

# Per-call fallbacks of these kinds make a TileLang row not what it claims to be (the step's heavy ops, and the
# compressor pooling and Engram ops since they have kernels: a Flash step runs no torch op).
STRICT_KINDS = ("sink_attention", "sink_attention_decode", "moe_router", "moe_experts", "linear", "indexer_scores",
                "indexer_scores_fp4", "index_topk_ids", "index_topk_rows", "compressor_pool", "engram_hash",
                "engram_gate", "window_kv", "mhc_collapse_norm")


# ---- roofline ---------------------------------------------------------------------------------------------------
def load_roofline(path: str | None = None):
    """benchmarks/roofline.py (the repo's verbatim copy of shared/tools/roofline.py), or an explicit path."""
    p = Path(path) if path else HERE / "roofline.py"
    spec = importlib.util.spec_from_file_location("roofline", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ROOFLINE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                 "qk_rope_head_dim", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
                 "num_experts_per_tok", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                 "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "hc_mult",
                 "vocab_size", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim")
ROOFLINE_LISTS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids")


def roofline_config(roofline, cfg) -> dict:
    """roofline.py's config dict for a ModelConfig: its FLASH defaults with every field the model has."""
    c = dict(roofline.FLASH)
    for k in ROOFLINE_KEYS:
        if getattr(cfg, k, None) is not None:
            c[k] = getattr(cfg, k)
    for k in ROOFLINE_LISTS:
        c[k] = list(getattr(cfg, k, None) or [])
    if c["candidate_source_layer_id"] is None:  # no candidate source: roofline.py's comparison needs an int
        c["candidate_source_layer_id"] = c["num_hidden_layers"]
    return c


def step_roofline(roofline, c: dict, bw: float, peak: float, batch: int, context: int, prefill_tokens: int = 0):
    """The whole step's floor: (bytes, flops, floor ms = max(bytes/BW, flops/peak), bandwidth ms, compute ms)."""
    by, fl = roofline.step_floor(c, batch, context, prefill_tokens)
    bw_ms, fl_ms = by / bw * 1e3, fl / peak * 1e3
    return dict(bytes=by, flops=fl, floor_ms=max(bw_ms, fl_ms), bw_ms=bw_ms, compute_ms=fl_ms)


# ---- the fill backend -------------------------------------------------------------------------------------------
class _Bank:
    """Encoded random rows per cache format, drawn once; fills gather from them at random (no per-fill encode)."""

    def __init__(self, layout, device, gen, rows: int = 4096):
        def enc(codec, width):
            x = torch.randn(rows, width, generator=gen, device=device)  # unit variance: what the normed KV has
            return tuple(p.contiguous() for p in codec.encode(x))

        self.rows = rows
        self.window = enc(layout.win_codec, layout.head_dim)
        self.compressed = enc(layout.cmp_codec, layout.head_dim)
        self.keys = enc(layout.key_codec, layout.index_dim)
        self.open = torch.randn(rows, 2, layout.head_dim, generator=gen, device=device)  # raw fp32 (kv, gate)


def fill_step(model, batch, gen, chunk: int = 32768, banks: dict | None = None) -> torch.Tensor:
    """The benchmark's prefill stage: per sequence (chunks of `chunk` tokens, so the [tokens, window] metadata
    stays small), the model's own step metadata (pack_step + derive) says where each token's cache rows live; random
    valid codes are written there and the sequence's token count advances, as model.forward would leave it.
    Returns random float32 logits of the shape the real stage returns."""
    from deepinfer.models.cache import derive, pack_step

    pools = batch.states[0].pools
    layout, dev = pools.layout, pools.device
    banks = banks if banks is not None else {}
    bank = banks.get(id(pools))
    if bank is None:
        bank = banks[id(pools)] = _Bank(layout, dev, gen)

    def scatter(parts, rows, bank_parts):
        pick = torch.randint(0, bank.rows, (rows.numel(),), generator=gen, device=dev)
        for p, b in zip(parts, bank_parts):
            p.index_copy_(0, rows, b[pick])  # masked tokens all go to the trash row, never read back

    for ids, st in zip(batch.token_ids, batch.states):
        for at in range(0, len(ids), chunk):
            piece = list(ids[at: at + chunk])
            if st._allocator is not None:  # standalone pools (no engine): take blocks as model.forward does
                st._allocator.grow(st, st.num_tokens + len(piece))
            meta = derive(pack_step([piece], [st], layout, dev), pools)
            for parts in pools.window + pools.draft_window:  # the DSpark context keys share the window's rows
                scatter(parts, meta.window.write_row, bank.window)
            pools.win_pos.index_copy_(0, meta.window.write_row, meta.positions.to(torch.int32))
            for s, src in layout.sources.items():
                rows = meta.entry_rows[src.ratio]
                scatter(pools.compressed[s], rows, bank.compressed)
                if s in pools.index_keys:
                    scatter(pools.index_keys[s], rows, bank.keys)
                if s in pools.open_groups:
                    w = meta.groups[src.ratio].open_write_row
                    pick = torch.randint(0, bank.rows, (w.numel(),), generator=gen, device=dev)
                    pools.open_groups[s].index_copy_(0, w, bank.open[pick])
            if meta.ngram is not None:  # Engram history: the compressed ids of the tokens, as the model writes
                pools.ngram.index_copy_(0, meta.ngram[1], model.engram_token_map[meta.ids])
            st.num_tokens += len(piece)
    n = sum(len(t) for t in batch.token_ids) if batch.all_logits else len(batch.token_ids)
    return torch.randn(n, model.config.vocab_size, generator=gen, device=dev)


def engine_backend(model, fill: bool, seed: int = 0, replay=None, same_fill: bool = False):
    """The engine's backend for `model`: the plain one (real prefill and decode), or with `fill` the benchmark's
    (prefill = fill_step, decode = the model). Built from backend_from_model so every other field the runner uses
    (e.g. for CUDA graphs) is the real one. `replay`: the YOCO replay stage (models/replay.py BoundedReplay), which
    the engine's runner applies to prefill steps as it does the pipeline's (yoco=mask|compact); None: yoco=off.
    `same_fill`: every fill starts from `seed` again (bank and draws), so a later generate of the same prompts, all
    in one prefill step, finds the same context (dspark_gpu.py replays the target's continuation as drafts). The
    fill starts once make_engine arms it: what the engine prefills while it starts (the varlen planner profiling
    its cost curve) runs the model, so the curve prices real forwards, not fills."""
    from deepinfer.engine.backend import backend_from_model
    from deepinfer.kernels.registry import batch_invariant

    backend = backend_from_model(model, batch_invariant=batch_invariant())  # the sampler follows the op set's mode
    if replay is not None:
        backend = dataclasses.replace(backend, replay=replay)
    if fill:
        gen = torch.Generator(model.device).manual_seed(seed)
        banks: dict = {}
        real, armed = backend.prefill, []

        def prefill(batch):
            if not armed:  # the engine's own steps before any request (varlen's cost curve): real forwards
                return real(batch)
            if same_fill:
                gen.manual_seed(seed)
                banks.clear()
            return fill_step(model, batch, gen, banks=banks)

        prefill.arm = lambda: armed.append(True)  # make_engine, once the engine is up
        backend = dataclasses.replace(backend, prefill=prefill)
    return backend


# ---- running the engine -----------------------------------------------------------------------------------------
class StepTap:
    """Records every StepStats the engine core sends (LLMEngine keeps only their summary): wraps the client's get."""

    def __init__(self, engine):
        self.steps: list = []
        inner = engine.client.get

        def get(*args, **kwargs):
            out = inner(*args, **kwargs)
            if out is not None:
                self.steps.extend(out.stats)
            return out

        engine.client.get = get

    def take(self) -> list:
        steps, self.steps = sorted(self.steps, key=lambda s: s.step_id), []
        return steps


def make_engine(model, *, fill: bool, max_seqs: int, context: int, max_tokens: int, graphs: bool, interval: int,
                batched_tokens: int, zero_overhead: bool = True, block_size: int = 64, num_draft: int = 0,
                seed: int = 0, replay=None, same_fill: bool = False, pool_tokens: int | None = None,
                varlen: bool = False):
    """An in-process engine (the model is built once per run and shared) with pools for max_seqs sequences of
    context + max_tokens tokens (`pool_tokens`: for that many tokens in all instead, sequences of different
    lengths): cache.memory_budget set from the pools' own layout. `num_draft`: DSpark drafts verified per step
    (0: plain decoding); `varlen`: confidence-scheduled verification lengths (decoding.varlen). `replay`,
    `same_fill`: engine_backend's."""
    from deepinfer.config.schema import Settings
    from deepinfer.engine import EngineOptions
    from deepinfer.frontend import LLMEngine

    layout = (model.cache_layout(block_size, num_draft + 1, drafts=True) if num_draft
              else model.cache_layout(block_size))
    max_len = context + max_tokens + block_size
    blocks = max_seqs * math.ceil(max_len / block_size) if pool_tokens is None else \
        math.ceil(pool_tokens / block_size) + max_seqs
    budget = int((max_seqs * layout.slot_bytes() + blocks * layout.block_bytes()) * 1.01) + (1 << 20)
    backend = engine_backend(model, fill, seed, replay, same_fill)
    opts = EngineOptions.for_settings(Settings(), max_num_seqs=max_seqs, max_num_batched_tokens=batched_tokens,
                                      max_model_len=max_len, memory_budget=budget, block_size=block_size,
                                      process="inproc", zero_overhead_scheduling=zero_overhead,
                                      enforce_eager=not graphs, cudagraph_batch_size_interval=interval, seed=0,
                                      num_draft_tokens=num_draft, spec_varlen=varlen)
    engine = LLMEngine(lambda: backend, opts)
    getattr(backend.prefill, "arm", lambda: None)()
    return engine, StepTap(engine), budget


def _fallback_delta(before: dict, after: dict) -> dict:
    out = {}
    for kind, reasons in after.items():
        for reason, n in reasons.items():
            d = n - before.get(kind, {}).get(reason, 0)
            if d:
                out.setdefault(kind, {})[reason] = d
    return out


def run_decode(engine, tap, batch: int, context: int, warmup: int, steps: int, vocab: int, seed: int = 0):
    """B requests of `context` random tokens, greedy, max_tokens = 1 + warmup + steps; returns the timed decode
    steps (decode-only steps of B rows after the first `warmup`) and the run's metrics summary."""
    from deepinfer import SamplingParams
    from deepinfer.kernels.registry import kernel_stats

    g = torch.Generator().manual_seed(seed + batch * 7919 + context)
    prompts = torch.randint(3, min(500, vocab), (batch, context), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=1 + warmup + steps, ignore_eos=True)
    before = kernel_stats()["fallbacks"]
    outs = engine.generate(prompts, sp, use_tqdm=False)
    fallbacks = _fallback_delta(before, kernel_stats()["fallbacks"])
    errors = [o.error for o in outs if o.finish_reason == "error"]
    all_steps = tap.take()
    decode = [s for s in all_steps if s.num_prefill_tokens == 0 and s.num_rows == batch]
    return decode[warmup: warmup + steps], all_steps, engine.last_metrics, fallbacks, errors


def portable(text: str) -> str:
    """`text` with the machine's own paths (the device's $OUT, the JIT manifest and cache, the checkout, the working
    directory) written as the names the README's commands use, so a result reads the same wherever it was made."""
    for var in ("OUT", "DEEPINFER_JIT_MANIFEST", "DEEPINFER_JIT_CACHE_DIR", "TILELANG_CACHE_DIR"):
        value = os.environ.get(var)
        if value and len(value) > 1:
            text = text.replace(value.rstrip("/"), f"${var}")
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):  # the checkout: the device runs from a copy
        text = text.replace(str(root).rstrip("/") + "/", "")
    return text


def portable_json(obj) -> str:
    """JSON for benchmarks/results/, its paths portable()."""
    return portable(json.dumps(obj, indent=1, default=str))


PROFILE_STEPS = 4  # decode steps profile_decode's longer run has beyond its shorter one


def profile_decode(engine, tap, batch: int, context: int, vocab: int, steps: int = PROFILE_STEPS) -> dict:
    """Kernel time of one decode step (graphs replay their kernels individually under CUPTI): two short runs of
    the same cell under torch.profiler, one with `steps` more decode steps than the other; per kernel, the
    difference of their CUDA time and count over those steps, so that what runs once per run (the context fill,
    the prefill, the first step) cancels out. Untimed otherwise: the profiler's own overhead never enters the
    table's step times."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(n_steps: int) -> tuple[dict, int]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            timed, *_ = run_decode(engine, tap, batch, context, 1, n_steps, vocab, seed=99)
        per = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
            if t > 0 and ev.count:
                per[ev.key] = (t / 1e3, ev.count)
        return per, len(timed)

    # an unprofiled run first: the profile engine's first step of this batch captures its graph, whose warm-up is
    # one more eager forward that only the first run would hold (the short run's, until the fortieth session: every
    # profile then covered 3 of its 4 steps, its counts and times 0.75 of a step's)
    run_decode(engine, tap, batch, context, 1, 1, vocab, seed=98)
    (short, n0), (long, n1) = kernels(1), kernels(1 + steps)
    if n1 - n0 != steps:
        raise RuntimeError(f"decode_gpu --profile: {n0} and {n1} decode steps of {batch} rows, wanted {steps} apart")
    top = sorted(((k, (ms - short.get(k, (0.0, 0))[0]) / steps, round((c - short.get(k, (0.0, 0))[1]) / steps, 2))
                  for k, (ms, c) in long.items() if c > short.get(k, (0.0, 0))[1]), key=lambda r: -r[1])
    routers = sum(c for k, _, c in top if k.startswith("router_logits"))  # once a layer (every V4.1 layer is MoE)
    return dict(decode_steps=steps, timed_steps=n1, kernels=round(sum(c for _, _, c in top)),
                cuda_ms=sum(ms for _, ms, _ in top), router_calls=routers, top=top[:40])


def profile_cells(a, model, ops, cells: list, flush, failures: list) -> None:
    """Profile (profile_decode) each timed (ctx, batch, row) of the first variant, one engine a context as the
    timed cells had, and attach the profile to its row."""
    model.use_ops(ops)
    graphs = a.variants[0] == "graphs" and torch.cuda.is_available()
    for ctx in sorted({c for c, _, _ in cells}):
        mine = [(b, row) for c, b, row in cells if c == ctx]
        # tokens a sequence for profile_decode's longer run (run_decode: 1 + warm-up + steps)
        engine, tap, _ = make_engine(model, fill=True, max_seqs=max(b for b, _ in mine), context=ctx,
                                     max_tokens=1 + 1 + (1 + PROFILE_STEPS), graphs=graphs, interval=a.interval,
                                     batched_tokens=max(b for b, _ in mine) * (ctx + 1), zero_overhead=not a.sync)
        try:
            for b, row in mine:
                prof = row["profile"] = profile_decode(engine, tap, b, ctx, model.config.vocab_size)
                prof["layers"] = model.config.num_hidden_layers
                if prof["router_calls"] != prof["layers"]:  # the step the profile saw is not one whole step
                    failures.append(f"profile B={b} ctx={ctx}: the router ran {prof['router_calls']} times a step "
                                    f"for {prof['layers']} layers: the profile did not cover whole steps")
                    prof["invalid"] = True
                # the step's time beyond its kernels' (host work on the step's path, idle gaps; negative where the
                # shared expert's side stream overlaps the main one): of 21 ms at B=256/32K, ~10 were the host
                # building the block table from Python lists
                prof["outside_kernels_ms"] = row.get("step_ms", float("nan")) - prof["cuda_ms"]
                print(f"profile B={b} ctx={ctx}: one decode step, {prof['kernels']} kernels, {prof['cuda_ms']:.3f} "
                      f"ms of kernel time ({prof['outside_kernels_ms']:+.1f} ms of the step outside them); top:",
                      flush=True)
                for name, ms, n in prof["top"][:15]:
                    print(f"   {ms:8.3f} ms  x{n:<6g} {name[:110]}", flush=True)
                flush()
        finally:
            engine.close()
            del engine, tap
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def decode_row(variant, backend, graphs, batch, context, timed, all_steps, summary, fallbacks, errors, roof, steps):
    dur = [s.device_end - s.device_start for s in timed]
    gaps = [b.device_start - a.device_end for a, b in zip(timed, timed[1:])]
    row = dict(mode="decode", variant=variant, backend=backend, graphs=graphs, batch=batch, context=context,
               context_source="filled", timed_steps=len(timed), engine_steps=len(all_steps),
               graph_steps_timed=sum(1 for s in timed if s.graph), graph_steps=summary.get("graph_steps"),
               fallbacks=fallbacks, errors=errors[:3], floor=roof)
    if dur:
        med = statistics.median(dur)
        span = timed[-1].device_end - timed[0].device_start
        row.update(step_ms=med * 1e3, step_ms_min=min(dur) * 1e3, gap_ms=statistics.median(gaps) * 1e3 if gaps else 0.0,
                   tok_s=batch * len(timed) / span, tok_s_device=batch / med,
                   pct_roofline=roof["floor_ms"] / (med * 1e3) * 100)
        row["tok_s_per_user"] = row["tok_s"] / batch
    return row


# The targets this benchmark measures (issue 21: decode, % of the step's memory roofline, graphs on, on the 40-layer
# model, the same table on the 6-layer one for continuity; issue 20: prefill, % of the compute roofline). Keys:
# (batch, context); context None: every context.
DECODE_TARGETS = {(1, None): 40.0, (8, None): 50.0, (64, 4096): 65.0, (64, 32768): 55.0, (256, 4096): 55.0,
                  (256, 32768): 45.0}
PREFILL_TARGET = 40.0  # % of the compute roofline, 8K and 32K prompts
KERNELS_PER_LAYER = 50  # issue 21's launch target: kernels of a B=1 decode step per layer, from a --profile row


def targets(rows: list[dict]) -> list[dict]:
    """The JSON's top-level `targets`: one entry per target a row of this run measured."""
    out = []
    for r in rows:
        if r.get("mode") == "prefill" and r.get("tokens") in (8192, 32768) and "pct_compute_roofline" in r:
            got = round(r["pct_compute_roofline"], 1)
            out.append(dict(name=f"prefill of {r['tokens']} tokens, % of the compute roofline", measured=got,
                            target=PREFILL_TARGET, unit="%", met=got >= PREFILL_TARGET))
        elif r.get("mode") == "decode" and r.get("variant") == "graphs" and "pct_roofline" in r:
            want = DECODE_TARGETS.get((r["batch"], r["context"]), DECODE_TARGETS.get((r["batch"], None)))
            if want is not None:
                got = round(r["pct_roofline"], 1)
                out.append(dict(name=f"decode B={r['batch']} ctx={r['context']}, % of the step roofline",
                                measured=got, target=want, unit="%", met=got >= want))
            prof = r.get("profile")
            if r["batch"] == 1 and prof and prof.get("layers") and not prof.get("invalid"):
                got = round(prof["kernels"] / prof["layers"], 1)
                out.append(dict(name=f"decode B=1 ctx={r['context']}, kernels per layer of a step", measured=got,
                                target=KERNELS_PER_LAYER, unit="kernels", met=got <= KERNELS_PER_LAYER))
    return out


def check_decode(row, want_steps: int) -> list[str]:
    """Why this row is not what it claims to be (empty: it is)."""
    name = f"decode {row['variant']} B={row['batch']} ctx={row['context']}"
    bad = []
    if row["errors"]:
        bad.append(f"{name}: requests ended with errors: {row['errors']}")
    if row["timed_steps"] < want_steps:
        bad.append(f"{name}: {row['timed_steps']} timed decode steps of {row['batch']} rows, wanted {want_steps}")
    if row["graphs"] and row["graph_steps_timed"] < row["timed_steps"]:
        bad.append(f"{name}: graphs requested, but {row['timed_steps'] - row['graph_steps_timed']} of "
                   f"{row['timed_steps']} timed steps ran eagerly (engine graph_steps={row['graph_steps']})")
    if not row["graphs"] and row["graph_steps"]:
        bad.append(f"{name}: graphs off (enforce_eager) but graph_steps={row['graph_steps']}")
    if row["backend"] == "tilelang":
        strict = {k: v for k, v in row["fallbacks"].items() if k in STRICT_KINDS}
        if strict:
            bad.append(f"{name}: per-call fallbacks to torch in a TileLang run: {strict}")
    return bad


def run_prefill(model, tokens: int, chunk: int, seed: int = 1):
    """One request of `tokens` random tokens, max_tokens 1, the real model, chunks of `chunk` tokens."""
    from deepinfer import SamplingParams
    from deepinfer.kernels.registry import kernel_stats

    engine, tap, _ = make_engine(model, fill=False, max_seqs=1, context=tokens, max_tokens=1, graphs=False,
                                 interval=8, batched_tokens=chunk)
    try:
        g = torch.Generator().manual_seed(seed + tokens)
        prompt = torch.randint(3, min(500, model.config.vocab_size), (tokens,), generator=g).tolist()
        before = kernel_stats()["fallbacks"]
        out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                              use_tqdm=False)[0]
        fallbacks = _fallback_delta(before, kernel_stats()["fallbacks"])
        steps = [s for s in tap.take() if s.num_prefill_tokens]
    finally:
        engine.close()
    return steps, out.error, fallbacks


def prefill_row(tokens, chunk, steps, error, fallbacks, roof):
    dev = sum(s.device_end - s.device_start for s in steps)
    row = dict(mode="prefill", variant="tilelang", batch=1, tokens=tokens, chunk=chunk, steps=len(steps),
               prefill_s=dev, step_ms=[(s.device_end - s.device_start) * 1e3 for s in steps], error=error,
               fallbacks=fallbacks, floor=roof)
    if dev > 0:
        row.update(tok_s=sum(s.num_prefill_tokens for s in steps) / dev,
                   pct_compute_roofline=roof["compute_ms"] / (dev * 1e3) * 100,
                   pct_roofline=roof["floor_ms"] / (dev * 1e3) * 100)
    return row


# ---- model ------------------------------------------------------------------------------------------------------
def build(model_name: str, device: str, backends, batch_invariant: bool = False, overrides: dict | None = None):
    """`flash` (synthetic FLASH_REDUCED, 6 layers, bf16), `flash40` (synthetic FLASH_FULL: the released 40-layer
    pattern, layers of one kind sharing weights; the roofline is the released model's) or `tiny` (the embedded
    checkpoint, with its draft layers; the CPU test's model). `overrides`: config fields for the synthetic models
    (e.g. synthetic.DSPARK_FLASH: the draft layers)."""
    if model_name == "tiny":
        from deepinfer.embedded import materialize
        from deepinfer.models import load_model

        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        return load_model(materialize("tiny-random"), device=device, dtype=dtype, backends=backends,
                          batch_invariant=batch_invariant)
    from deepinfer.models import synthetic

    cfg = synthetic.config(overrides, full_depth=model_name == "flash40")
    return synthetic.build_model(cfg, device, torch.bfloat16, backends=backends, batch_invariant=batch_invariant)


def ceilings(device: str, roofline):
    """(copy bytes/s, bf16 GEMM FLOP/s): measured on CUDA (as the kernel benchmarks do), roofline.py's defaults
    elsewhere (the CPU test only checks the arithmetic)."""
    if device.startswith("cuda"):
        from kernels_gpu import ceilings as measure  # HERE is on sys.path (top of the file)

        return measure()
    return 4.27e12, 699e12


# ---- main -------------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/decode_gpu.json")
    ap.add_argument("--plot", default=None, help="Pareto PNG: total tok/s vs tok/s per user")
    ap.add_argument("--model", choices=("flash", "flash40", "tiny"), default="flash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--variants", nargs="+", default=["graphs", "eager", "torch"],
                    help="graphs: TileLang + CUDA graphs; eager: TileLang, enforce_eager; torch: torch ops, eager")
    ap.add_argument("--torch-at", default=None, help="B:CTX,... the only cells the torch variant runs (default all)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (JIT, graph capture)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--torch-steps", type=int, default=2)
    ap.add_argument("--interval", type=int, default=8, help="cudagraph_batch_size_interval")
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--chunk", type=int, default=8192, help="prefill max_num_batched_tokens")
    ap.add_argument("--roofline", default=None, help="roofline.py to use (default benchmarks/roofline.py)")
    ap.add_argument("--sync", action="store_true", help="synchronous scheduling (default: async)")
    ap.add_argument("--plot-from", nargs="+", default=None,
                    help="with --plot: draw the Pareto PNG from recorded result JSON files' decode rows (no GPU); a "
                         "(variant, batch, context) cell in several files is taken from the last")
    ap.add_argument("--targets-from", nargs="+", default=None,
                    help="only recompute the `targets` of recorded result JSON files from their rows (no GPU)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="DEEPINFER_BATCH_INVARIANT=1: the batch-invariant op set and sampler (its cost: run twice)")
    ap.add_argument("--profile", default=None,
                    help="B:CTX,... cells of the first variant to profile once more after every cell is timed "
                         "(torch.profiler): the kernels of one decode step by CUDA time, in the JSON row and the "
                         "printed output")
    ap.add_argument("--routing", action="store_true",
                    help="after the timed cells, count the distinct routed experts one eager decode step of each "
                         "batch touches (routing_spread.py) and give each decode row its % of the floor at those "
                         "experts beside roofline.py's (uniform routing)")
    ap.add_argument("--quick", action="store_true",
                    help="B 1 and 64, ctx 4K and 32K, graphs on/off, torch only at B=64/4K, prefill 8K")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.contexts, a.torch_at, a.prefill, a.steps, a.warmup = [1, 64], [4096, 32768], "64:4096", [8192], 5, 2
    return a


def retarget(path: str) -> None:
    """Recompute a recorded result file's `targets` from its rows (files written before the list existed)."""
    data = read_json(path)
    data = dict(meta=data["meta"], targets=on_card(targets(data["rows"]), data["meta"]["gpu"]), rows=data["rows"],
                    failures=data["failures"])
    with open_result(path, "w") as f:  # an .xz stays compressed
        f.write(portable_json(data))


def main(argv=None) -> int:
    a = parse(argv)
    if a.targets_from:
        for path in a.targets_from:
            retarget(path)
            print("targets recomputed:", path)
        return 0
    if a.plot_from:
        if not a.plot:
            print("decode_gpu.py: --plot-from needs --plot PATH", file=sys.stderr)
            return 2
        cells, models = {}, set()
        for path in a.plot_from:
            data = read_json(path)
            models.add(data["meta"]["model"])
            for r in data["rows"]:
                if r["mode"] == "decode" and "tok_s" in r:
                    cells[(r["variant"], r["batch"], r["context"])] = r
        if len(models) != 1:
            print(f"decode_gpu.py: --plot-from files are of different models: {sorted(models)}", file=sys.stderr)
            return 2
        plot(list(cells.values()), a.plot, models.pop())
        print("wrote", a.plot)
        return 0
    from deepinfer.kernels.registry import OpSet, kernel_stats

    t_start = time.time()
    roofline = load_roofline(a.roofline)
    on_cuda = a.device.startswith("cuda")
    bw, peak = ceilings(a.device, roofline)
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s", flush=True)
    prefs = {"default": ["tilelang-sm90", "torch"]} if on_cuda else ["torch"]
    t0 = time.time()
    model = build(a.model, a.device, prefs, a.batch_invariant)
    fast_ops = model.ops
    ref_ops = OpSet.build(model.device.type, ["torch"], batch_invariant=a.batch_invariant)
    dev = model.device
    memory = dict(held_gb=torch.cuda.memory_allocated(dev) / 1e9,
                  build_peak_gb=torch.cuda.max_memory_allocated(dev) / 1e9,
                  device_gb=torch.cuda.get_device_properties(dev).total_memory / 1e9) if on_cuda else {}
    print(f"model {a.model} built in {time.time() - t0:.0f} s"
          + (" ({held_gb:.1f} GB held, build peak {build_peak_gb:.1f} GB of {device_gb:.1f})".format(**memory)
             if memory else "")
          + "; ops: " + ", ".join(f"{k}={v}" for k, v in fast_ops.summary().items()), flush=True)
    c = roofline_config(roofline, model.config)
    torch_cells = None if a.torch_at is None else {tuple(map(int, x.split(":"))) for x in a.torch_at.split(",")}
    meta = dict(gpu=torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
                torch=torch.__version__, copy_bw=bw, bf16_flops=peak, model=a.model, batch_invariant=a.batch_invariant,
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), cmd=" ".join(sys.argv), host=platform.node(),
                note=FILLED_NOTE, scheduling="sync" if a.sync else "async", ops=fast_ops.summary(),
                warmup=a.warmup, steps=a.steps, torch_steps=a.torch_steps, interval=a.interval, memory=memory)
    rows, failures = [], []

    def flush():
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        meta["kernels"] = kernel_stats()
        meta["wall_s"] = time.time() - t_start
        with open(a.out, "w") as f:
            f.write(portable_json(dict(meta=meta, targets=on_card(targets(rows), meta["gpu"]), rows=rows,
                                       failures=failures)))

    # Prefill: the real model. The first, untimed, compiles every kernel variant the timed chunks use.
    model.use_ops(fast_ops)
    if a.prefill:
        run_prefill(model, min(a.chunk, min(a.prefill)), a.chunk)
    for tokens in a.prefill:
        steps, error, fallbacks = run_prefill(model, tokens, a.chunk)
        row = prefill_row(tokens, a.chunk, steps, error, fallbacks, step_roofline(roofline, c, bw, peak, 1, tokens,
                                                                                  prefill_tokens=tokens))
        rows.append(row)
        if error:
            failures.append(f"prefill {tokens}: {error}")
        strict = {k: v for k, v in fallbacks.items() if k in STRICT_KINDS} if on_cuda else {}
        if strict:
            failures.append(f"prefill {tokens}: per-call fallbacks to torch in a TileLang run: {strict}")
        print(f"prefill {tokens:6d} tokens in {row['steps']} steps: {row['prefill_s'] * 1e3:9.1f} ms, "
              f"{row.get('tok_s', 0):9.0f} tok/s, {row.get('pct_compute_roofline', 0):5.1f}% of the compute roofline",
              flush=True)
        flush()

    # cells profiled after every cell is timed: CUPTI stays attached once torch.profiler has run (kineto tears it
    # down only with TEARDOWN_CUPTI=1, which CUDA graphs do not survive), and the steps timed after a profile ran
    # slower (H200, 40 layers: B=8 20.51 ms right after B=1's profile, 18.79 in DSpark's plain row of the same
    # session; 19.20 / 19.24 in a run without profiles)
    profiled = {tuple(map(int, x.split(":"))) for x in a.profile.split(",")} if a.profile else set()
    to_profile = []
    for variant in a.variants:
        graphs = variant == "graphs" and on_cuda
        model.use_ops(ref_ops if variant == "torch" else fast_ops)
        backend = "torch" if variant == "torch" or not on_cuda else "tilelang"
        steps = a.torch_steps if variant == "torch" else a.steps
        warmup = min(a.warmup, 1) if variant == "torch" else a.warmup
        for ctx in a.contexts:
            cells = [b for b in a.batches if variant != "torch" or torch_cells is None or (b, ctx) in torch_cells]
            if not cells:
                continue
            max_tokens = 1 + warmup + steps
            t0 = time.time()
            engine, tap, budget = make_engine(model, fill=True, max_seqs=max(cells), context=ctx,
                                              max_tokens=max_tokens, graphs=graphs, interval=a.interval,
                                              batched_tokens=max(cells) * (ctx + 1), zero_overhead=not a.sync)
            print(f"-- {variant} ctx={ctx}: engine up in {time.time() - t0:.1f} s, cache budget "
                  f"{budget / 2**30:.2f} GiB ({engine.info.cache_description})", flush=True)
            try:
                for b in cells:
                    t0 = time.time()
                    timed, all_steps, summary, fallbacks, errors = run_decode(engine, tap, b, ctx, warmup, steps,
                                                                              model.config.vocab_size)
                    roof = step_roofline(roofline, c, bw, peak, b, ctx)
                    row = decode_row(variant, backend, graphs, b, ctx, timed, all_steps, summary, fallbacks, errors,
                                     roof, steps)
                    row["run_s"] = time.time() - t0
                    graphs_obj = getattr(getattr(getattr(engine.client, "core", None), "runner", None), "graphs", None)
                    if graphs_obj is not None:  # buckets whose capture failed run eagerly: say why in the row
                        row["graph_capture_failures"] = {str(k): v for k, v in graphs_obj.failures().items()}
                    if variant == a.variants[0] and (b, ctx) in profiled:
                        to_profile.append((ctx, b, row))
                    rows.append(row)
                    bad = check_decode(row, steps)
                    failures += bad
                    print(f"decode {variant:6s} B={b:<4d} ctx={ctx:<6d} step {row.get('step_ms', float('nan')):9.2f} ms"
                          f" gap {row.get('gap_ms', float('nan')):6.2f} ms | {row.get('tok_s', 0):9.0f} tok/s"
                          f" ({row.get('tok_s_per_user', 0):7.1f}/user) | floor {roof['floor_ms']:7.3f} ms"
                          f" ({row.get('pct_roofline', 0):5.1f}%) | graphs {row['graph_steps_timed']}/"
                          f"{row['timed_steps']} | {row['run_s']:.1f} s" + ("  FAILED: " + "; ".join(bad) if bad else ""),
                          flush=True)
                    if row.get("pct_roofline", 0) > 100:  # a denominator below what the step achieved: say so
                        warn = (f"{variant} B={b} ctx={ctx}: {row['pct_roofline']:.1f}% of the roofline: the step "
                                f"moved its bytes faster than the copy bandwidth measured here ({bw / 1e12:.2f} "
                                f"TB/s), so % of roofline overstates on this card (--routing: the floor at the "
                                f"experts it touched)")
                        print("WARNING:", warn, flush=True)
                        meta.setdefault("warnings", []).append(warn)
                    flush()
                    if a.plot:  # redrawn as rows arrive: a run cut at its time limit keeps a plot
                        plot(rows, a.plot, a.model)
            finally:
                engine.close()
                del engine, tap
                gc.collect()
                if on_cuda:
                    torch.cuda.empty_cache()
    model.use_ops(fast_ops)
    if a.routing:  # before the profiles: one eager step a batch, and the count a run short of time must not lose
        routing_rows(model, rows, c, bw)
        flush()
    profile_cells(a, model, fast_ops, to_profile, flush, failures)
    flush()
    print("wrote", a.out)
    if a.plot:
        plot(rows, a.plot, a.model)
        print("wrote", a.plot)
    print(table(rows, meta))
    if failures:
        print("\nFAILED: these variants did not run as asked:\n  " + "\n  ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


def routing_rows(model, rows: list[dict], c: dict, bw: float) -> None:
    """--routing: each decode row's `routed` (routing_spread.routed_floor at the experts one eager decode step of its
    batch touched), printed per batch."""
    from routing_spread import routed_experts, routed_floor  # HERE is on sys.path (top of the file)

    decode = [r for r in rows if r["mode"] == "decode" and "step_ms" in r]
    for b in sorted({r["batch"] for r in decode}):
        counts = routed_experts(model, b)
        line = []
        for r in (r for r in decode if r["batch"] == b):
            rf = routed_floor(c, r["floor"], bw, b, counts)
            r["routed"] = dict(rf, pct_roofline=rf["floor_ms"] / r["step_ms"] * 100)
            line.append(f"{r['variant']} ctx={r['context']} {r['routed']['pct_roofline']:.1f}%")
        print(f"routing B={b}: {rf['experts_measured']:.1f} distinct experts per MoE layer ({rf['moe_calls']} "
              f"layers; uniform {rf['experts_uniform']:.1f}); of the floor at those experts: " + ", ".join(line),
              flush=True)


def table(rows, meta) -> str:
    lines = [f"\n{meta['gpu']}, model {meta['model']}, {meta['scheduling']} scheduling; {FILLED_NOTE}.",
             "decode: variant   B    ctx    | step ms | gap ms | tok/s     | tok/s/user | roofline ms | % roofline "
             "| graph steps"]
    for r in rows:
        if r["mode"] == "decode" and "step_ms" in r:
            lines.append(f"        {r['variant']:8s} {r['batch']:<4d} {r['context']:<6d} | {r['step_ms']:7.2f} | "
                         f"{r['gap_ms']:6.2f} | {r['tok_s']:9.0f} | {r['tok_s_per_user']:10.1f} | "
                         f"{r['floor']['floor_ms']:11.3f} | {r['pct_roofline']:9.1f}% | "
                         f"{r['graph_steps_timed']}/{r['timed_steps']}")
    lines.append("prefill: tokens (chunk) | steps | ms      | tok/s    | compute floor ms | % compute roofline")
    for r in rows:
        if r["mode"] == "prefill" and "tok_s" in r:
            lines.append(f"         {r['tokens']:6d} ({r['chunk']}) | {r['steps']:5d} | {r['prefill_s'] * 1e3:7.1f} | "
                         f"{r['tok_s']:8.0f} | {r['floor']['compute_ms']:16.1f} | {r['pct_compute_roofline']:17.1f}%")
    return "\n".join(lines)


MODEL_TITLES = {"flash": "V4.1-Flash width (6 layers)", "flash40": "V4.1-Flash, 40 layers (weights shared by kind)",
                "tiny": "the embedded tiny model"}


def plot(rows, path, model="flash"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in rows if r["mode"] == "decode" and "tok_s" in r]
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for (variant, ctx) in sorted({(r["variant"], r["context"]) for r in dec}):
        pts = sorted((r["tok_s_per_user"], r["tok_s"], r["batch"]) for r in dec
                     if r["variant"] == variant and r["context"] == ctx)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if ctx <= 8192 else "s--",
                label=f"{variant}, ctx {ctx // 1024}K")
        for x, y, b in pts:
            ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens/s per user (decode)")
    ax.set_ylabel("total decode tokens/s")
    ax.set_title(f"DeepInfer engine, {MODEL_TITLES[model]}: decode Pareto\n(context filled, not prefilled)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
