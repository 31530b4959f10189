"""Prefill on the GPU through the engine (issue 20 item 8): prompts of several lengths, one and several at once,
on the Flash-width synthetic models (`flash`: 6 layers; `flash40`: the released 40-layer pattern with weights
shared between layers of one kind, so a step moves the released model's bytes and does its FLOPs).

Per cell: tokens/s over the device time of the prefill steps, the mean time to first token (host clock, from the
request metrics), % of the compute roofline (../shared/tools/roofline.py's FLOPs over the bf16 GEMM rate measured
in this run; the FP8 GEMM rate measured here is reported beside it). One prefill of each `--profile-tokens` (8K by
default) runs under the profiler and its kernel time is split into attention, indexer, top-k, projections, MoE,
compressor, Engram, mHC and other, so the next bottleneck is visible; the attention and MoE rates against their
targets come from the 8K table. The
torch backend prefills the shortest prompt in the same run. Each TileLang cell runs once untimed first (a step
size first met compiles kernel variants: 27 s inside one timed 8K cell before this). A TileLang run that fell back
to a torch op in a timed step, a request that failed, or a missing cell makes the script exit 1.

Mixed steps (`--mixed-tokens`, default 16384; 0: skip): that prompt prefilled in chunks of each `--mixed-chunks`
(max_num_batched_tokens 2K / 4K / 8K / 16K) while `--mixed-decoders` (64) requests decode beside it, against the
same prompt alone at the same chunk: prefill tok/s over the device time of the steps where every decoder decoded
and prompt tokens were prefilled. Each chunk runs once untimed first.

YOCO (`--yoco-tokens`, default 32768; 0: skip): one prompt of that many tokens prefilled with yoco=off and with
yoco=compact (K = `--yoco-keep`, 140 as DeepInfer's Flash recipes), the same prompt and chunks on the same model,
through the engine with the replay stage the pipeline gives it (EngineBackend.replay: the runner applies it to
prefill steps exactly as for `yoco=compact`). Each mode runs once untimed first (the compact rows' sizes may
compile other kernel variants), then once timed; the target is the ratio of the device times of the prefill steps.
The run fails when compact did not skip the decoder-layer rows the replay stage accounts for (the engine's
replay_rows_saved against BoundedReplay.rows_saved over the steps' chunks), or off skipped any.

  python benchmarks/prefill_gpu.py --model flash40 --out benchmarks/results/prefill_gpu_flash40_h200.json \
      --plot benchmarks/results/prefill_gpu_flash40_h200.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from decode_gpu import (STRICT_KINDS, _fallback_delta, build, ceilings, load_roofline, make_engine,  # noqa: E402
                        portable_json, roofline_config, step_roofline)
from target_card import on_card  # noqa: E402

CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("compressor", ("compressor_pool",)),
    ("Engram", ("engram",)),
    ("attention", ("sink_attention", "attention_combine")),
    ("indexer", ("indexer",)),
    ("top-k", ("topk", "top_k", "sort", "radix")),
    ("MoE", ("grouped_gemm", "moe_", "expert_gemm", "grouped_mm", "groupproblem", "grouped")),
    ("projections", ("fp8_linear", "split_reduce", "gemm", "gemv", "cutlass", "sm90_xmma", "nvjet")),
    ("mHC", ("mhc",)),
    ("norm/rope/quant", ("rms", "rope", "quant")),
]


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def fp8_rate() -> float:
    """FP8 x FP8 GEMM FLOP/s (torch._scaled_mm, 8192^3, per-tensor scales): the rate an FP8 prefill could reach."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def run_cell(model, tokens: int, n: int, chunk: int, seed: int = 1, replay=None):
    """n requests of `tokens` random tokens at once, max_tokens 1; (steps, outputs, fallbacks). `replay`: YOCO's
    replay stage (None: yoco=off)."""
    from deepinfer import SamplingParams
    from deepinfer.kernels.registry import kernel_stats

    engine, tap, _ = make_engine(model, fill=False, max_seqs=n, context=tokens, max_tokens=1, graphs=False,
                                 interval=8, batched_tokens=chunk, replay=replay)
    try:
        g = torch.Generator().manual_seed(seed + tokens + n)
        hi = min(500, model.config.vocab_size)
        prompts = [torch.randint(3, hi, (tokens,), generator=g).tolist() for _ in range(n)]
        before = kernel_stats()["fallbacks"]
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                               use_tqdm=False)
        fallbacks = _fallback_delta(before, kernel_stats()["fallbacks"])
        steps = [s for s in tap.take() if s.num_prefill_tokens]
    finally:
        engine.close()
    return steps, outs, fallbacks


def yoco_prefill(model, tokens: int, chunk: int, keep: int = 140, warmup: bool = True, seed: int = 5) -> dict:
    """One prompt of `tokens` tokens prefilled with yoco=off and yoco=compact (K = `keep`) through the engine, same
    prompt and chunks: per mode the device time of its prefill steps, tok/s, the decoder-layer rows the engine
    reports skipped (StepStats.replay_rows_saved) and the per-call fallbacks; `speedup` = off / compact device
    time; `failures` says why the measurement is not what it claims to be (empty: it is)."""
    from deepinfer.models.replay import BoundedReplay

    replay = BoundedReplay(model.config, "compact", keep)
    modes = (("off", None), ("compact", replay))
    if warmup:  # untimed: kernel variants for the compact rows' sizes compile here
        for _, rp in modes:
            run_cell(model, tokens, 1, chunk, seed=seed, replay=rp)
    out, failures = dict(tokens=tokens, keep=keep, chunk=chunk, boundary=replay.boundary,
                         consumer_layers=replay.num_consumer_layers), []
    for mode, rp in modes:
        steps, outs, fallbacks = run_cell(model, tokens, 1, chunk, seed=seed, replay=rp)
        dev = sum(s.device_end - s.device_start for s in steps)
        past, expected = 0, 0
        for s in steps:  # what the replay stage accounts for the chunks the scheduler made
            n = s.num_prefill_tokens
            if rp is not None and rp.applies([n], [past], [tokens]):
                expected += rp.rows_saved([n], [past], [tokens])
            past += n
        saved = sum(s.replay_rows_saved for s in steps)
        errors = [o.error for o in outs if o.error]
        out[mode] = dict(device_s=dev, tok_s=tokens / dev if dev > 0 else None, steps=len(steps),
                         prefill_tokens=past, rows_saved=saved, rows_saved_expected=expected, fallbacks=fallbacks,
                         errors=errors)
        if errors or past != tokens:
            failures.append(f"yoco={mode}: {errors or f'{past} of {tokens} prompt tokens prefilled'}")
        if saved != expected:
            failures.append(f"yoco={mode}: {saved} decoder-layer rows skipped, the replay stage accounts {expected}")
        if rp is not None and saved == 0:
            failures.append(f"yoco={mode}: no decoder-layer row skipped (a prompt of {tokens} tokens, K={keep})")
    off, comp = out["off"]["device_s"], out["compact"]["device_s"]
    out["speedup"] = off / comp if off > 0 and comp > 0 else None
    out["failures"] = failures
    return out


def mixed_cell(model, tokens: int, chunk: int, decoders: int = 64, short: int = 128, seed: int = 3) -> dict:
    """Issue 20 item 6: one prompt of `tokens` tokens prefilled in chunks of `chunk` while `decoders` requests
    (prompts of `short` tokens, submitted first) decode beside it, against the same prompt alone at that chunk.
    Mixed steps = steps with every decoder decoding and prefill tokens (the long prompt's chunks); prefill tok/s
    over their device time, and alone; `failures` says why the measurement is not what it claims to be."""
    from deepinfer import SamplingParams

    g = torch.Generator().manual_seed(seed + tokens + chunk)
    hi = min(500, model.config.vocab_size)
    long_prompt = torch.randint(3, hi, (tokens,), generator=g).tolist()
    shorts = [torch.randint(3, hi, (short,), generator=g).tolist() for _ in range(decoders)]
    steps_needed = -(-(tokens + decoders * short) // max(1, chunk - decoders)) + 4  # the decoders outlast the prefill
    params = [SamplingParams(temperature=0.0, max_tokens=steps_needed, ignore_eos=True)] * decoders
    params.append(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    engine, tap, _ = make_engine(model, fill=False, max_seqs=decoders + 1, context=tokens, max_tokens=steps_needed,
                                 graphs=False, interval=8, batched_tokens=chunk,
                                 pool_tokens=tokens + decoders * (short + steps_needed) + 1024)
    try:
        outs = engine.generate(shorts + [long_prompt], params, use_tqdm=False)
        steps = tap.take()
    finally:
        engine.close()
    mixed = [s for s in steps if s.num_prefill_tokens and s.num_decode_tokens >= decoders]
    dev = sum(s.device_end - s.device_start for s in mixed)
    pre = sum(s.num_prefill_tokens for s in mixed)
    alone_steps, alone_outs, _ = run_cell(model, tokens, 1, chunk, seed=seed)
    alone = sum(s.device_end - s.device_start for s in alone_steps)
    failures = [f"mixed {tokens}/{chunk}: {o.error}" for o in outs + alone_outs if o.error]
    if not mixed:
        failures.append(f"mixed {tokens}/{chunk}: no step prefilled beside {decoders} decoding requests")
    elif pre < tokens // 2:
        failures.append(f"mixed {tokens}/{chunk}: only {pre} of {tokens} prompt tokens beside the decoders")
    return dict(tokens=tokens, chunk=chunk, decoders=decoders, mixed_steps=len(mixed), mixed_prefill_tokens=pre,
                mixed_device_s=dev, mixed_decode_tokens=sum(s.num_decode_tokens for s in mixed),
                tok_s=pre / dev if dev > 0 else None, alone_device_s=alone,
                alone_tok_s=tokens / alone if alone > 0 else None,
                ratio=(pre / dev) / (tokens / alone) if dev > 0 and alone > 0 else None, failures=failures)


def profile_prefill(model, tokens: int, chunk: int) -> dict:
    """Kernel time of one prefill of `tokens` tokens by category (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_cell(model, tokens, 1, chunk, seed=7)
    per, kernels = {}, {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count:
            cat = category(ev.key)
            ms, cnt = per.get(cat, (0.0, 0))
            per[cat] = (ms + t / 1e3, cnt + ev.count)
            kernels[ev.key] = (t / 1e3, ev.count)
    top = sorted(((k, ms, c) for k, (ms, c) in kernels.items()), key=lambda r: -r[1])[:60]
    return dict(tokens=tokens, total_ms=sum(ms for ms, _ in per.values()),
                categories={k: dict(ms=ms, calls=c) for k, (ms, c) in sorted(per.items(), key=lambda kv: -kv[1][0])},
                top=top)


def attention_flops(cfg, tokens: int) -> float:
    """QK and PV of every layer: each query over its window plus (compressed layers) index_topk entries."""
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        keys = cfg.sliding_window + (cfg.index_topk if cfg.compress_ratios[layer] else 0)
        total += 4.0 * tokens * cfg.num_attention_heads * cfg.head_dim * keys
    return total


def moe_flops(cfg, tokens: int) -> float:
    """Routed top-k plus the shared expert: three [hidden x inter] GEMMs each, every layer."""
    per_token = (cfg.num_experts_per_tok + 1) * 3 * 2 * cfg.hidden_size * cfg.moe_intermediate_size
    return per_token * tokens * cfg.num_hidden_layers


def targets(rows, prof, cfg, peak, model_name, yoco: dict | None = None) -> list[dict]:
    out = []
    for want in (8192, 32768):
        r = next((r for r in rows if r["tokens"] == want and r["n"] == 1 and r["backend"] == "tilelang"), None)
        got = None if r is None else r.get("pct_compute_roofline")
        out.append(dict(name=f"prefill of {want} tokens on {model_name}, % of the compute roofline", measured=got,
                        target=40.0, unit="%", met=got is not None and got >= 40.0))
    cats = prof["categories"] if prof else {}
    att = cats.get("attention", {}).get("ms")
    rate = attention_flops(cfg, prof["tokens"]) / (att / 1e3) / 1e12 if att else None
    out.append(dict(name="sparse prefill attention at 8K, TFLOP/s", measured=rate, target=350.0, unit="TFLOP/s",
                    met=rate is not None and rate >= 350.0))
    moe = cats.get("MoE", {}).get("ms")
    frac = moe_flops(cfg, prof["tokens"]) / (moe / 1e3) / peak * 100 if moe else None
    out.append(dict(name="prefill MoE, % of the bf16 GEMM rate measured in the run", measured=frac, target=55.0,
                    unit="%", met=frac is not None and frac >= 55.0))
    if yoco is None:
        out.append(dict(name="yoco=compact vs off at 32K prefill (x)", measured=None, target=1.8, unit="x", met=False,
                        note="not measured in this run"))
    else:
        got, n = yoco["speedup"], yoco["tokens"]
        size = f"{n // 1024}K" if n % 1024 == 0 else f"{n}-token"
        out.append(dict(name=f"yoco=compact vs off at {size} prefill (x)", measured=got,
                        target=1.8, unit="x", met=got is not None and got >= 1.8,
                        note=f"{model_name}: decoder layers {yoco['boundary']}.. ({yoco['consumer_layers']} of "
                             f"{cfg.num_hidden_layers}), K={yoco['keep']}, {yoco['chunk']}-token chunks"))
    fb = sum(1 for r in rows if r["backend"] == "tilelang" and any(k in STRICT_KINDS for k in r["fallbacks"]))
    if yoco is not None:
        fb += sum(1 for m in ("off", "compact") if any(k in STRICT_KINDS for k in yoco[m]["fallbacks"]))
    out.append(dict(name="torch fallbacks in a Flash prefill step", measured=fb, target=0, unit="cells", met=fb == 0))
    return out


def plot(rows, path: str, title: str = "H200") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tokens in sorted({r["tokens"] for r in rows}):
        pts = sorted((r["ttft_s"], r["tok_s"], r["n"]) for r in rows
                     if r["tokens"] == tokens and r["backend"] == "tilelang" and "tok_s" in r)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{tokens} tokens")
            for t, s, n in pts:
                ax.annotate(f"x{n}", (t, s), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("mean time to first token (s)")
    ax.set_ylabel("prefill tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Prefill: throughput vs time to first token ({title}; xN = prompts at once)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("flash", "flash40"), default="flash")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--at-once", type=int, nargs="+", default=[1, 4], help="prompts submitted together")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--max-cell-tokens", type=int, default=65536, help="skip cells of more tokens in all")
    ap.add_argument("--profile-tokens", type=int, nargs="*", default=[8192],
                    help="prompts profiled per kernel (the targets read the 8K one)")
    ap.add_argument("--torch-tokens", type=int, default=1024, help="the torch backend's prompt (0: none)")
    ap.add_argument("--yoco-tokens", type=int, default=32768, help="the yoco=off vs compact prompt (0: none)")
    ap.add_argument("--yoco-keep", type=int, default=140, help="K, the rows per sequence the decoder layers keep")
    ap.add_argument("--mixed-tokens", type=int, default=16384,
                    help="the prompt prefilled beside decoding requests (0: skip the mixed-step cells)")
    ap.add_argument("--mixed-chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                    help="max_num_batched_tokens of the mixed-step cells")
    ap.add_argument("--mixed-decoders", type=int, default=64, help="requests decoding beside the prefill")
    ap.add_argument("--out", default="benchmarks/results/prefill_gpu.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--moe-path", choices=("auto", "stream", "grouped"), default="auto",
                    help="MoE at prefill sizes: the engine's choice (moe_prefill.PREFILL_TOKENS), or always the "
                         "streaming FP4 kernel, or always the dequantise + grouped GEMM path (to compare them)")
    return ap.parse_args(argv)


def force_moe_path(path: str) -> None:
    from deepinfer.kernels.tilelang import moe_prefill

    if path != "auto":
        moe_prefill.PREFILL_TOKENS = 1 << 40 if path == "stream" else 1


def main(argv=None) -> int:
    a = parse(argv)
    from deepinfer.kernels.registry import OpSet, kernel_stats

    t_start = time.time()
    roofline = load_roofline(None)
    bw, peak = ceilings("cuda", roofline)
    f8 = fp8_rate()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s, fp8 GEMM {f8 / 1e12:.0f} "
          "TFLOP/s", flush=True)
    force_moe_path(a.moe_path)
    model = build(a.model, "cuda", {"default": ["tilelang-sm90", "torch"]})
    fast_ops = model.ops
    c = roofline_config(roofline, model.config)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak,
                fp8_flops=f8, model=a.model, moe_path=a.moe_path, cmd=" ".join(sys.argv), ops=fast_ops.summary(),
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                note="flash40: the released 40-layer pattern, layers of one kind share weights (released bytes "
                     "and FLOPs per step)" if a.model == "flash40" else "flash: 6 layers, every layer role once")
    rows, failures = [], []
    cells = [(t, n, "tilelang") for t in a.tokens for n in a.at_once if t * n <= a.max_cell_tokens]
    if a.torch_tokens:
        cells.append((a.torch_tokens, 1, "torch"))
    for tokens, n, backend in cells:
        ref = OpSet.build("cuda", ["torch"]) if backend == "torch" else fast_ops
        model.use_ops(ref)
        if backend == "tilelang":  # untimed first: the kernel variants this cell's step sizes need compile here
            run_cell(model, tokens, n, a.chunk, seed=2)
        steps, outs, fallbacks = run_cell(model, tokens, n, a.chunk)
        model.use_ops(fast_ops)
        dev = sum(s.device_end - s.device_start for s in steps)
        one = step_roofline(roofline, c, bw, peak, 1, tokens, prefill_tokens=tokens)  # n independent prompts
        roof = {k: v * n if k.endswith("_ms") else v for k, v in one.items()}
        errors = [o.error for o in outs if o.error]
        ttft = [o.metrics.time_to_first_token for o in outs if o.metrics and o.metrics.time_to_first_token]
        row = dict(tokens=tokens, n=n, backend=backend, chunk=a.chunk, steps=len(steps), device_s=dev,
                   fallbacks=fallbacks, errors=errors, floor=roof)
        if dev > 0:
            row.update(tok_s=tokens * n / dev, pct_compute_roofline=roof["compute_ms"] / (dev * 1e3) * 100,
                       pct_fp8_rate=roof["compute_ms"] * peak / f8 / (dev * 1e3) * 100,
                       ttft_s=sum(ttft) / len(ttft) if ttft else None)
        rows.append(row)
        if errors or not steps:
            failures.append(f"{tokens}x{n} {backend}: {errors or 'no prefill step recorded'}")
        strict = {k: v for k, v in fallbacks.items() if k in STRICT_KINDS}
        if backend == "tilelang" and strict:
            failures.append(f"{tokens}x{n}: fell back to torch in a TileLang run: {strict}")
        print(f"{backend:8s} {tokens:6d} x{n}: {dev * 1e3:9.1f} ms device, {row.get('tok_s', 0):8.0f} tok/s, "
              f"TTFT {row.get('ttft_s') or 0:6.2f} s, {row.get('pct_compute_roofline', 0):5.1f}% of the compute "
              f"roofline", flush=True)
    profiles = [profile_prefill(model, n, a.chunk) for n in a.profile_tokens]
    for prof in profiles:
        print(f"profile of one {prof['tokens']}-token prefill: {prof['total_ms']:.1f} ms of kernel time")
        for cat, v in prof["categories"].items():
            print(f"  {cat:16s} {v['ms']:9.1f} ms  {v['ms'] / prof['total_ms'] * 100:5.1f}%  {v['calls']:6d} calls")
        for name, ms, calls in [t for t in prof["top"] if category(t[0]) == "other"][:8]:  # what "other" is
            print(f"    other: {ms:8.1f} ms {calls:5d} calls  {name[:110]}")
    prof = next((p for p in profiles if p["tokens"] == 8192), None)
    mixed = []
    for chunk in (a.mixed_chunks if a.mixed_tokens else []):
        mixed_cell(model, a.mixed_tokens, chunk, a.mixed_decoders)  # untimed: this chunk's kernel variants
        m = mixed_cell(model, a.mixed_tokens, chunk, a.mixed_decoders)
        mixed.append(m)
        failures += m["failures"]
        print(f"mixed {a.mixed_tokens:6d} tokens, chunk {chunk:6d}, {a.mixed_decoders} decoding: "
              f"{m['tok_s'] or 0:8.0f} prefill tok/s in {m['mixed_steps']} mixed steps "
              f"({m['mixed_prefill_tokens']} prompt tokens), alone {m['alone_tok_s'] or 0:8.0f} tok/s, "
              f"ratio {m['ratio'] or 0:.2f}", flush=True)
    yoco = None
    if a.yoco_tokens:
        try:
            yoco = yoco_prefill(model, a.yoco_tokens, a.chunk, a.yoco_keep)
        except Exception as exc:  # noqa: BLE001 (the JSON is still written; the run fails)
            failures.append(f"yoco: {type(exc).__name__}: {exc}")
    if yoco is not None:
        failures += yoco["failures"]
        for mode in ("off", "compact"):
            r = yoco[mode]
            strict = {k: v for k, v in r["fallbacks"].items() if k in STRICT_KINDS}
            if strict:
                failures.append(f"yoco={mode}: fell back to torch in a TileLang run: {strict}")
            print(f"yoco={mode:7s} {a.yoco_tokens:6d} x1: {r['device_s'] * 1e3:9.1f} ms device, "
                  f"{r['tok_s'] or 0:8.0f} tok/s, decoder-layer rows skipped {r['rows_saved']}", flush=True)
        print(f"yoco=compact vs off: {yoco['speedup'] or 0:.2f}x", flush=True)
    tg = on_card(targets(rows, prof, model.config, peak, a.model, yoco), meta["gpu"])
    for t in tg:
        card = f" (set for the H200; on this card: {t['met_on_this_card']})" if "met_on_this_card" in t else ""
        print(f"target: {t['name']}: {t['measured']} (target {t['target']} {t['unit']}) met={t['met']}{card}")
    meta["kernels"] = kernel_stats()
    meta["wall_s"] = time.time() - t_start
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        f.write(portable_json(dict(meta=meta, targets=tg, rows=rows, mixed=mixed, yoco=yoco,
                                   profiles=profiles, failures=failures)))
    if a.plot:
        plot(rows, a.plot, f"{a.model}, {meta['gpu']}")
    for msg in failures:
        print("FAILED:", msg)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
