#!/usr/bin/env python3
"""One forward step of a DeepSeek-V4.1-Flash-width model of reduced depth on the GPU, layer by layer, through the
model's own code and cache state: decode at several batches and contexts, and prefill; TileLang backend vs the
torch reference ops on the same GPU in the same run, against the roofline.

    python3 benchmarks/layer_gpu.py [--out benchmarks/results/layer_gpu.json] [--plot layer_gpu.png] [--quick]

Model: deepinfer.models.synthetic.FLASH_REDUCED (hidden 5120, 64 heads x 512, 384 experts top-6 of width 2304,
window 128, index top-512; six layers: SWA, SWA + Engram, ratio-2 KV+index source, ratio-2 reuse, ratio-1
KV+index+candidate source, ratio-1 reindex) with random weights in the released formats (FP4 routed experts and
FP8 shared expert held as stored; FP8 projections dequantised to bf16 at load, as load_model does).
Context: one sequence is prefilled to the context (chunks of --chunk tokens, each chunk timed: the prefill rows),
its state is cloned for every sequence of the batch, then decode steps append one random token per sequence.
Times: CUDA events at the model's layer boundaries (model.layer_hook), median over --steps steps, eager (Python
dispatch included: no CUDA graph; the model's per-sequence Python work is part of the step). Roofline: bytes and
FLOPs per layer from ../shared/tools/roofline.py (its FP8-projection / FP4-expert byte counts; the same layer
schedule) over the copy bandwidth and bf16 GEMM rate measured at the start of the run.
"""

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kernels_gpu import ceilings  # noqa: E402

ROOFLINE_PATHS = (HERE.parent.parent / "shared" / "tools" / "roofline.py", HERE.parent / ".devtools" / "roofline.py")


def load_roofline(path):
    for p in ([Path(path)] if path else ROOFLINE_PATHS):
        if p.is_file():
            spec = importlib.util.spec_from_file_location("roofline", p)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    raise SystemExit(f"roofline.py not found (looked at {', '.join(map(str, ROOFLINE_PATHS))}); pass --roofline")


def roofline_config(roofline, cfg):
    c = dict(roofline.FLASH)
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
              "qk_rope_head_dim", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
              "num_experts_per_tok", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
              "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "hc_mult", "vocab_size",
              "engram_max_ngram_size", "engram_n_heads", "engram_head_dim"):
        c[k] = getattr(cfg, k)
    for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        c[k] = list(getattr(cfg, k))
    return c


class LayerClock:
    """model.layer_hook: one CUDA event per layer boundary."""

    def __init__(self):
        self.events = []

    def __call__(self, i):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.events.append(e)

    def layer_ms(self):
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]


def timed_forward(model, batch):
    clock = LayerClock()
    model.layer_hook = clock
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model.forward(batch)
    end.record()
    layers = clock.layer_ms()
    model.layer_hook = None
    return start.elapsed_time(end), layers


def decode(model, states, steps, warmup, gen):
    from deepinfer.models import ForwardBatch

    step_ms, layer_ms = [], []
    for s in range(warmup + steps):
        toks = torch.randint(3, 500, (len(states),), generator=gen).tolist()
        ms, layers = timed_forward(model, ForwardBatch([[t] for t in toks], states))
        if s >= warmup:
            step_ms.append(ms)
            layer_ms.append(layers)
    return statistics.median(step_ms), [statistics.median(col) for col in zip(*layer_ms)]


def count_syncs(model, states, gen):
    """One decode step under torch's sync debug mode: the host-device synchronisations the step makes (each one
    drains the GPU queue, so host and GPU stop overlapping)."""
    import warnings

    from deepinfer.models import ForwardBatch

    toks = torch.randint(3, 500, (len(states),), generator=gen).tolist()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.forward(ForwardBatch([[t] for t in toks], states))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            key = f"{Path(w.filename).name}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
    return where


def prefill(model, n_tokens, chunk, gen):
    """A fresh sequence prefilled to n_tokens in chunks; returns (state, [(chunk step ms, layer ms)])."""
    from deepinfer.models import ForwardBatch

    state = model.new_state()
    out = []
    for start in range(0, n_tokens, chunk):
        n = min(chunk, n_tokens - start)
        ids = torch.randint(3, 500, (n,), generator=gen).tolist()
        out.append(timed_forward(model, ForwardBatch([ids], [state])))
    return state, out


def floors(roofline, c, n_layers, bw, peak, batch, context, prefill_tokens=0):
    res = []
    for layer in range(n_layers):
        by, fl = roofline.layer_floor(c, layer, batch, context, prefill_tokens)
        res.append(dict(bytes=by, flops=fl, ms=max(by / bw, fl / peak) * 1e3, bw_ms=by / bw * 1e3,
                        flop_ms=fl / peak * 1e3))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/layer_gpu.json")
    ap.add_argument("--plot", default=None, help="PNG of decode time per layer vs batch beside the roofline")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (a prefill row per chunk count)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--torch-steps", type=int, default=2)
    ap.add_argument("--torch-prefill", type=int, default=8192, help="torch-reference prefill length (0: none)")
    ap.add_argument("--roofline", default=None)
    ap.add_argument("--torch-kinds", default="", help="op kinds kept on the torch ops in the TileLang run (a,b)")
    ap.add_argument("--quick", action="store_true", help="batches 1 64, context 4096, no torch prefill")
    a = ap.parse_args()
    if a.quick:
        a.batches, a.contexts, a.torch_prefill = [1, 64], [4096], 0

    from deepinfer.kernels.registry import OpSet
    from deepinfer.models import synthetic

    roofline = load_roofline(a.roofline)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    bw, peak = ceilings()
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s", flush=True)
    t0 = time.time()
    cfg = synthetic.config()
    prefs = {"default": ["tilelang-sm90", "torch"], **{k: ["torch"] for k in a.torch_kinds.split(",") if k}}
    model = synthetic.build_model(cfg, "cuda", torch.bfloat16, backends=prefs)
    n_layers = cfg.num_hidden_layers
    tl_ops, ref_ops = model.ops, OpSet.build("cuda", ["torch"])
    print(f"model built in {time.time() - t0:.0f} s; {torch.cuda.memory_allocated() / 2**30:.1f} GiB; ops: "
          + ", ".join(f"{k}={v}" for k, v in tl_ops.summary().items()), flush=True)
    c = roofline_config(roofline, cfg)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, bf16_flops=peak,
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), cmd=" ".join(sys.argv), host=platform.node(),
                config=synthetic.FLASH_REDUCED, ops=tl_ops.summary())
    rows = []

    def flush():
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    def add(row):
        rows.append(row)
        flush()
        lay = row["layer_ms"]
        fl = [f["ms"] for f in row["floor"]]
        frac = sum(fl) / sum(lay)
        print(f"{row['mode']:7s} {row['backend']:8s} B={row['batch']:<4d} ctx={row['context']:<6d} "
              f"tokens={row['tokens']:<6d} step {row['step_ms']:9.2f} ms | layers "
              + " ".join(f"{x:8.2f}" for x in lay) + f" | floor {sum(fl):7.3f} ms ({frac * 100:5.1f}% of roofline)",
              flush=True)
        if a.plot and row["mode"] == "decode":  # redrawn as rows arrive: a run cut at its time limit keeps a plot
            plot(rows, a.plot, n_layers)

    # compile every kernel variant the timed prefill chunks use before timing (TileLang JIT variants depend on the
    # token count, e.g. the mHC split count; cuBLAS heuristics)
    for ops, sizes in ((tl_ops, sorted({min(c, a.chunk) for c in a.contexts})), (ref_ops, [a.torch_prefill])):
        model.use_ops(ops)
        for n in sizes:
            if n:
                prefill(model, n, n, gen)
    bases = {}
    for ctx in sorted(set(a.contexts)):
        model.use_ops(tl_ops)
        state, chunks = prefill(model, ctx, a.chunk, gen)
        bases[ctx] = state
        done = 0
        for ms, layers in chunks:
            n = min(a.chunk, ctx - done)
            add(dict(mode="prefill", backend="tilelang", batch=1, context=done + n, tokens=n, step_ms=ms,
                     layer_ms=layers, floor=floors(roofline, c, n_layers, bw, peak, 1, done + n, n)))
            done += n
    if a.torch_prefill:
        model.use_ops(ref_ops)
        _, chunks = prefill(model, a.torch_prefill, a.chunk, gen)
        ms, layers = chunks[0]
        n = min(a.chunk, a.torch_prefill)
        add(dict(mode="prefill", backend="torch", batch=1, context=n, tokens=n, step_ms=ms, layer_ms=layers,
                 floor=floors(roofline, c, n_layers, bw, peak, 1, n, n)))

    for ctx in a.contexts:
        for b in a.batches:
            states = [synthetic.clone_state(bases[ctx]) for _ in range(b)]
            if b == a.batches[0] and ctx == a.contexts[0]:
                model.use_ops(tl_ops)
                syncs = count_syncs(model, states, gen)
                meta["decode_syncs"] = syncs
                print(f"host-device syncs in one decode step: {sum(syncs.values())} {syncs}", flush=True)
            for backend, ops, steps in (("tilelang", tl_ops, a.steps), ("torch", ref_ops, a.torch_steps)):
                if steps <= 0:
                    continue
                model.use_ops(ops)
                try:
                    ms, layers = decode(model, states, steps, 1, gen)
                except torch.OutOfMemoryError as exc:
                    print(f"decode {backend} B={b} ctx={ctx}: out of memory ({str(exc)[:120]})", flush=True)
                    rows.append(dict(mode="decode", backend=backend, batch=b, context=ctx, error="out of memory"))
                    torch.cuda.empty_cache()
                    continue
                add(dict(mode="decode", backend=backend, batch=b, context=ctx, tokens=b, step_ms=ms,
                         layer_ms=layers, floor=floors(roofline, c, n_layers, bw, peak, b, ctx)))
            del states
            torch.cuda.empty_cache()
    model.use_ops(tl_ops)
    summarize(rows)
    flush()
    print("wrote", a.out)
    if a.plot:
        plot(rows, a.plot, n_layers)
        print("wrote", a.plot)


def summarize(rows):
    """Per-layer mean time, fraction of roofline and speedup over torch, decode rows."""
    by = {(r["backend"], r["batch"], r["context"], r["mode"]): r for r in rows if "error" not in r}
    print("\nmode    B    ctx    | tilelang ms/layer | roofline ms/layer | % roofline | torch ms/layer | speedup")
    for (backend, b, ctx, mode), r in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][2], kv[0][1])):
        if backend != "tilelang":
            continue
        n = len(r["layer_ms"])
        t = sum(r["layer_ms"]) / n
        f = sum(x["ms"] for x in r["floor"]) / n
        ref = by.get(("torch", b, ctx, mode))
        rt = sum(ref["layer_ms"]) / n if ref and ref["tokens"] == r["tokens"] else None
        print(f"{mode:7s} {b:<4d} {ctx:<6d} | {t:17.3f} | {f:17.4f} | {f / t * 100:9.1f}% | "
              + (f"{rt:14.3f} | {rt / t:6.1f}x" if rt else f"{'-':>14s} | {'-':>7s}"))


def plot(rows, path, n_layers):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in rows if r.get("mode") == "decode" and "error" not in r]
    contexts = sorted({r["context"] for r in dec})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for backend, style in (("tilelang", "o-"), ("torch", "s--")):
            pts = sorted((r["batch"], sum(r["layer_ms"]) / n_layers) for r in dec
                         if r["backend"] == backend and r["context"] == ctx)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{backend} ops")
        pts = sorted({(r["batch"], sum(f["ms"] for f in r["floor"]) / n_layers) for r in dec if r["context"] == ctx})
        ax.plot(*zip(*pts), "k:", label="roofline (max of bytes/BW, FLOPs/peak)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode batch (sequences)")
        ax.set_ylabel("ms per layer (mean of the 6 layers)")
        ax.set_title(f"V4.1-Flash width, decode step, context {ctx}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



if __name__ == "__main__":
    main()
