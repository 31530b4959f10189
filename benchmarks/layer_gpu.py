#!/usr/bin/env python3
"""One forward step of a DeepSeek-V4.1-Flash-width model of reduced depth on the GPU, layer by layer, through the
model's own code and cache pools: decode at several batches and contexts, and prefill; TileLang backend vs the
torch reference ops on the same GPU in the same run, against the roofline.

    source benchmarks/gpu_env.sh
    python3 benchmarks/layer_gpu.py [--out benchmarks/results/layer_gpu.json] [--plot layer_gpu.png] [--quick]
    python3 benchmarks/layer_gpu.py --model tiny --device cpu ...   # the CPU test's path (embedded tiny model)

Model: deepinfer.models.synthetic.FLASH_REDUCED (hidden 5120, 64 heads x 512, 384 experts top-6 of width 2304,
window 128, index top-512; six layers: SWA, SWA + Engram, ratio-2 KV+index source, ratio-2 reuse, ratio-1
KV+index+candidate source, ratio-1 reindex) with random weights in the released formats (FP4 routed experts and
FP8 shared expert held as stored; FP8 projections too, as load_model does on CUDA).
DECODE CONTEXT IS FILLED, NOT PREFILLED: one set of cache pools (model.allocate_cache, block size 64) sized for the
largest batch x the largest context; per cell every sequence of the batch gets its own slot and blocks
(SequenceCache), and its context is written by decode_gpu.py's fill_step (random valid FP8/FP4 cache codes at the
rows the step metadata names; the token count advances as a prefill would leave it), then decode steps append one
random token per sequence through the real model. The attention work of a decode step depends on the context
length and the pool layout, not on the cached values. PREFILL rows are the real model: one sequence prefilled to
each context in chunks of --chunk tokens, each chunk timed.
Times: CUDA events at the model's layer boundaries (model.layer_hook; perf_counter on the CPU), median over --steps
steps, eager (Python dispatch included: no CUDA graph; the model's per-step host work is part of the step).
Roofline: bytes and FLOPs per layer from ../shared/tools/roofline.py (or its verbatim copy benchmarks/roofline.py;
its FP8-projection / FP4-expert byte counts; the same layer schedule) over the copy bandwidth and bf16 GEMM rate
measured at the start of the run (roofline.py's defaults on the CPU).
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

from decode_gpu import build, ceilings, fill_step, portable_json, roofline_config  # noqa: E402
from target_card import on_card  # noqa: E402

ROOFLINE_PATHS = (HERE.parent.parent / "shared" / "tools" / "roofline.py", HERE / "roofline.py")
BLOCK_SIZE = 64
FILLED_NOTE = "decode context filled with random valid cache codes (decode_gpu.fill_step), not prefilled by the model"


def load_roofline(path):
    for p in ([Path(path)] if path else ROOFLINE_PATHS):
        if p.is_file():
            spec = importlib.util.spec_from_file_location("roofline", p)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    raise SystemExit(f"roofline.py not found (looked at {', '.join(map(str, ROOFLINE_PATHS))}); pass --roofline")


class LayerClock:
    """model.layer_hook: one CUDA event per layer boundary (host perf_counter on the CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events = []

    def __call__(self, i=None):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
        else:
            e = time.perf_counter()
        self.events.append(e)

    def elapsed(self):
        """ms between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.events, self.events[1:])]


def timed_forward(model, batch):
    """(step ms, [ms per layer]) of one model.forward."""
    cuda = model.device.type == "cuda"
    clock, outer = LayerClock(cuda), LayerClock(cuda)
    model.layer_hook = clock
    try:
        outer()
        model.forward(batch)
        outer()
        (step,) = outer.elapsed()
        layers = clock.elapsed()
    finally:
        model.layer_hook = None
    return step, layers


def token_ids(model, n, gen):
    return torch.randint(3, min(500, model.config.vocab_size), (n,), generator=gen).tolist()


def decode_blocks(context, extra_tokens):
    """Blocks per sequence for `context` tokens plus `extra_tokens` decoded ones."""
    return -(-(context + extra_tokens) // BLOCK_SIZE)


def filled_sequences(model, pools, batch, context, blocks_per_seq, gen, fill_gen, banks):
    """`batch` sequences in `pools` (sequence i: slot i, blocks i*blocks_per_seq ...), each holding `context`
    tokens written by decode_gpu.fill_step (random valid cache codes at the rows the step metadata names), not by a
    prefill of the model."""
    from deepinfer.models import ForwardBatch
    from deepinfer.models.cache import SequenceCache

    if batch > pools.num_slots or batch * blocks_per_seq > pools.num_blocks:
        raise ValueError(f"pools of {pools.num_slots} slots / {pools.num_blocks} blocks cannot hold {batch} "
                         f"sequences of {blocks_per_seq} blocks")
    states = [SequenceCache(pools, i, range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    fill_step(model, ForwardBatch([token_ids(model, context, gen) for _ in states], states), fill_gen, banks=banks)
    return states


def decode(model, states, steps, warmup, gen):
    from deepinfer.models import ForwardBatch

    step_ms, layer_ms = [], []
    for s in range(warmup + steps):
        toks = token_ids(model, len(states), gen)
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

    toks = token_ids(model, len(states), gen)
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
    """A fresh sequence (in pools of its own, freed on return) prefilled by the real model to n_tokens in chunks;
    returns [(chunk step ms, layer ms)]."""
    from deepinfer.models import ForwardBatch
    from deepinfer.models.cache import SequenceCache

    blocks = decode_blocks(n_tokens, 0)
    state = SequenceCache(model.allocate_cache(1, blocks, BLOCK_SIZE), 0, range(blocks))
    out = []
    for start in range(0, n_tokens, chunk):
        n = min(chunk, n_tokens - start)
        out.append(timed_forward(model, ForwardBatch([token_ids(model, n, gen)], [state])))
    return out


def floors(roofline, c, n_layers, bw, peak, batch, context, prefill_tokens=0):
    res = []
    for layer in range(n_layers):
        by, fl = roofline.layer_floor(c, layer, batch, context, prefill_tokens)
        res.append(dict(bytes=by, flops=fl, ms=max(by / bw, fl / peak) * 1e3, bw_ms=by / bw * 1e3,
                        flop_ms=fl / peak * 1e3))
    return res


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/layer_gpu.json")
    ap.add_argument("--plot", default=None, help="PNG of decode time per layer vs batch beside the roofline")
    ap.add_argument("--model", choices=("flash", "tiny"), default="flash",
                    help="flash: synthetic FLASH_REDUCED; tiny: the embedded checkpoint (the CPU test's model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (a prefill row per chunk count)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--torch-steps", type=int, default=2)
    ap.add_argument("--torch-prefill", type=int, default=8192, help="torch-reference prefill length (0: none)")
    ap.add_argument("--roofline", default=None)
    ap.add_argument("--torch-kinds", default="", help="op kinds kept on the torch ops in the TileLang run (a,b)")
    ap.add_argument("--quick", action="store_true", help="batches 1 64, context 4096, no torch prefill")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.contexts, a.torch_prefill = [1, 64], [4096], 0
    return a


def main(argv=None) -> int:
    a = parse(argv)
    from deepinfer.kernels.registry import OpSet
    from deepinfer.models import synthetic

    on_cuda = a.device.startswith("cuda")
    fast = "tilelang" if on_cuda else "default"  # the backend name of the first op set (torch ops on the CPU)
    roofline = load_roofline(a.roofline)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    bw, peak = ceilings(a.device, roofline)
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 GEMM {peak / 1e12:.0f} TFLOP/s", flush=True)
    t0 = time.time()
    prefs = ({"default": ["tilelang-sm90", "torch"], **{k: ["torch"] for k in a.torch_kinds.split(",") if k}}
             if on_cuda else ["torch"])
    model = build(a.model, a.device, prefs)
    cfg = model.config
    fill_gen = torch.Generator(model.device).manual_seed(0)
    banks = {}
    n_layers = cfg.num_hidden_layers
    tl_ops, ref_ops = model.ops, OpSet.build(model.device.type, ["torch"])
    mem = f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB; " if on_cuda else ""
    print(f"model {a.model} built in {time.time() - t0:.0f} s; {mem}ops: "
          + ", ".join(f"{k}={v}" for k, v in tl_ops.summary().items()), flush=True)
    c = roofline_config(roofline, cfg)
    meta = dict(gpu=torch.cuda.get_device_name() if on_cuda else platform.processor() or "cpu",
                torch=torch.__version__, copy_bw=bw, bf16_flops=peak, model=a.model,
                time=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), cmd=" ".join(sys.argv), host=platform.node(),
                config=synthetic.FLASH_REDUCED if a.model == "flash" else a.model, ops=tl_ops.summary(),
                note=FILLED_NOTE, block_size=BLOCK_SIZE)
    rows = []

    def flush():
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(portable_json(dict(meta=meta, targets=on_card(targets(rows, fast), meta["gpu"]), rows=rows)))

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
    # prefill rows: the real model, one sequence per context
    for ctx in sorted(set(a.contexts)):
        model.use_ops(tl_ops)
        done = 0
        for ms, layers in prefill(model, ctx, a.chunk, gen):
            n = min(a.chunk, ctx - done)
            add(dict(mode="prefill", backend=fast, batch=1, context=done + n, tokens=n, step_ms=ms,
                     layer_ms=layers, floor=floors(roofline, c, n_layers, bw, peak, 1, done + n, n)))
            done += n
    if a.torch_prefill:
        model.use_ops(ref_ops)
        ms, layers = prefill(model, a.torch_prefill, a.chunk, gen)[0]
        n = min(a.chunk, a.torch_prefill)
        add(dict(mode="prefill", backend="torch", batch=1, context=n, tokens=n, step_ms=ms, layer_ms=layers,
                 floor=floors(roofline, c, n_layers, bw, peak, 1, n, n)))
    if on_cuda:
        torch.cuda.empty_cache()

    # decode: one set of pools for the largest batch x the largest context (+ the decoded tokens); every cell's
    # sequences take slots 0..B-1 and their own blocks, their context filled (random valid codes), not prefilled
    variants = [(fast, tl_ops, a.steps), ("torch", ref_ops, a.torch_steps)]
    extra = 1 + sum(1 + steps for _, _, steps in variants if steps > 0)  # the sync-count step + warm-up + timed
    blocks_per_seq = decode_blocks(max(a.contexts), extra)
    pools = model.allocate_cache(max(a.batches), max(a.batches) * blocks_per_seq, BLOCK_SIZE)
    meta["decode_pools_bytes"] = pools.nbytes()
    print(f"decode pools: {max(a.batches)} slots x {blocks_per_seq} blocks of {BLOCK_SIZE}, "
          f"{pools.nbytes() / 2**30:.2f} GiB ({pools.layout.describe()})", flush=True)
    for ctx in a.contexts:
        for b in a.batches:
            t0 = time.time()
            states = filled_sequences(model, pools, b, ctx, blocks_per_seq, gen, fill_gen, banks)
            if on_cuda:
                torch.cuda.synchronize()
            print(f"fill B={b} ctx={ctx}: {time.time() - t0:.1f} s", flush=True)
            if on_cuda and b == a.batches[0] and ctx == a.contexts[0]:
                model.use_ops(tl_ops)
                syncs = count_syncs(model, states, gen)
                meta["decode_syncs"] = syncs
                print(f"host-device syncs in one decode step: {sum(syncs.values())} {syncs}", flush=True)
            for backend, ops, steps in variants:
                if steps <= 0:
                    continue
                model.use_ops(ops)
                try:
                    ms, layers = decode(model, states, steps, 1, gen)
                except torch.OutOfMemoryError as exc:
                    print(f"decode {backend} B={b} ctx={ctx}: out of memory ({str(exc)[:120]})", flush=True)
                    rows.append(dict(mode="decode", backend=backend, batch=b, context=ctx, error="out of memory"))
                    if on_cuda:
                        torch.cuda.empty_cache()
                    continue
                add(dict(mode="decode", backend=backend, batch=b, context=ctx, tokens=b, step_ms=ms,
                         layer_ms=layers, context_source="filled",
                         floor=floors(roofline, c, n_layers, bw, peak, b, ctx)))
            del states
    del pools
    if on_cuda:
        torch.cuda.empty_cache()
    model.use_ops(tl_ops)
    summarize(rows, fast)
    flush()
    print("wrote", a.out)
    if a.plot:
        plot(rows, a.plot, n_layers)
        print("wrote", a.plot)
    return 0


ROOFLINE_TARGET, TORCH_TARGET = 50.0, 10.0  # issue 6: a decode layer step >= 50% of its roofline, >= 10x torch


def targets(rows: list[dict], fast: str = "tilelang") -> list[dict]:
    """Issue 6's layer targets on the decode rows that measured them: the fast backend's step (all layers) at B=1
    and 64 against its roofline, and at B=64 over the torch ops' step at the same context."""
    dec = {(r["backend"], r["batch"], r["context"]): r for r in rows if r["mode"] == "decode" and "error" not in r}
    out = []
    for (backend, b, ctx), r in dec.items():
        if backend != fast or b not in (1, 64):
            continue
        got = 100 * sum(f["ms"] for f in r["floor"]) / sum(r["layer_ms"])
        out.append(dict(name=f"decode layers B={b} ctx={ctx}, % of their roofline", measured=round(got, 1),
                        target=ROOFLINE_TARGET, unit="%", met=got >= ROOFLINE_TARGET))
        ref = dec.get(("torch", b, ctx))
        if b == 64 and ref:
            got = sum(ref["layer_ms"]) / sum(r["layer_ms"])
            out.append(dict(name=f"decode layers B=64 ctx={ctx}, torch ops' time over {fast}'s",
                            measured=round(got, 1), target=TORCH_TARGET, unit="x", met=got >= TORCH_TARGET))
    return out


def summarize(rows, fast="tilelang"):
    """Per-layer mean time, fraction of roofline and speedup over torch, decode rows."""
    by = {(r["backend"], r["batch"], r["context"], r["mode"]): r for r in rows if "error" not in r}
    print(f"\nmode    B    ctx    | {fast:>8s} ms/layer | roofline ms/layer | % roofline | torch ms/layer | speedup")
    for (backend, b, ctx, mode), r in sorted(by.items(), key=lambda kv: (kv[0][3], kv[0][2], kv[0][1])):
        if backend != fast:
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
        for backend in sorted({r["backend"] for r in dec}, key=lambda x: x == "torch"):  # TileLang (fast) first
            style = "s--" if backend == "torch" else "o-"
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
    sys.exit(main())
