"""The torch ops a decode step runs outside the registry's op kinds ("glue"), by the model source line that issues
them: on the GPU each such op is a kernel launch of its own beside the TileLang kernels (issue 21 item 2: a step's
launches per layer at B=1 down to <= 50). Counted on the CPU (the same Python runs on every device): a
TorchDispatchMode sees every aten op; the calls of the model's OpSet are wrapped so that what runs inside a
registry op counts as that op's, once. Ops that only make views (no launch on the GPU) are left out.

    python tools/glue_ops.py --model tiny --batch 1 --top 25       # the embedded model, one decode step
    python tools/glue_ops.py --model tiny --batch 1 4              # does glue grow with the batch?
    python tools/glue_ops.py --model narrow40                      # the released 40-layer pattern, narrow (CPU)
    python3 tools/glue_ops.py --model flash40 --device cuda          # H200 (source benchmarks/gpu_env.sh first)
    python3 tools/glue_ops.py --model flash40 --device cuda --inside # + the wrappers' torch ops, by op kind

Prints, per batch: registry op calls and glue ops per decode step (total and per layer), the glue by source
line (file:line, the aten ops issued there, calls per step), then the op calls by kind (with --inside, also the
torch ops each op kind issues inside its calls). A decode step here is the difference between two runs of the same
requests, one with `--steps` more tokens each, divided by `--steps`: prefill and engine start-up cancel out.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

# aten ops that only make views or read metadata: no kernel launch on the GPU
VIEW_OPS = {"view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze", "select",
            "slice", "expand", "detach", "alias", "reshape", "unbind", "split", "split_with_sizes", "chunk",
            "narrow", "diagonal", "view_as_real", "view_as_complex", "unfold", "lift_fresh", "_reshape_alias",
            "sym_size", "sym_stride", "sym_numel", "is_same_size", "empty", "empty_like", "empty_strided",
            "new_empty", "new_empty_strided", "_to_copy_noop", "item", "_local_scalar_dense", "dim", "size",
            "stride", "is_nonzero"}
HERE = str(Path(__file__).resolve().parent.parent)


class GlueCounter(TorchDispatchMode):
    """Counts aten ops issued outside a registry op, keyed by (our innermost source line, op name)."""

    def __init__(self):
        super().__init__()
        self.depth = 0          # > 0 inside a registry op call
        self.kind = None        # the outermost registry op being run
        self.glue = Counter()
        self.registry = Counter()
        self.inside = Counter()  # (op kind, aten op): what a registry op issues besides its own kernels
        self.active = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        # a `to` that changes nothing returns its input: no copy, no launch
        if self.active and name not in VIEW_OPS and not (name == "to" and out is args[0]):
            if self.depth == 0:
                self.glue[(_our_line(), name)] += 1
            else:
                self.inside[(self.kind, name)] += 1
        return out

    def wrap(self, ops) -> None:
        """Every op of the OpSet `ops` counted once per call, and what it runs inside not counted as glue."""
        for kind, fn in list(ops._fns.items()):
            ops._fns[kind] = self._wrapped(kind, fn)

    def _wrapped(self, kind, fn):
        def call(*args, **kwargs):
            if self.active and self.depth == 0:
                self.registry[kind] += 1
                self.kind = kind
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return call


def _our_line() -> str:
    """The innermost frame in this checkout's deepinfer/ or kernels/ (not this tool): where the op was asked for."""
    for fr in reversed(traceback.extract_stack(limit=40)):
        f = fr.filename
        if f.startswith(HERE) and "/tools/" not in f and "/torch/" not in f:
            return f"{f[len(HERE) + 1:]}:{fr.lineno}"
        if "/deepinfer/" in f and "/tools/" not in f and "site-packages/torch" not in f:
            return f"{f[f.rfind('/deepinfer/') + 1:]}:{fr.lineno}"
    return "?"


def count(model, counter: GlueCounter, batch: int, context: int, tokens: int) -> tuple[Counter, Counter, Counter]:
    """Glue, registry calls and the torch ops inside registry ops of a run of `batch` greedy requests of `context`
    prompt tokens and `tokens` outputs."""
    from decode_gpu import make_engine

    from deepinfer import SamplingParams

    # synchronous scheduling: the step runs in this thread, where the dispatch mode is active
    engine, _, _ = make_engine(model, fill=False, max_seqs=batch, context=context, max_tokens=tokens + 1,
                               graphs=False, interval=8, batched_tokens=max(256, batch * context),
                               zero_overhead=False)
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 200, (batch, context), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    counter.glue.clear()
    counter.registry.clear()
    counter.inside.clear()
    counter.active = True
    try:
        engine.generate(prompts, sp, use_tqdm=False)
    finally:
        counter.active = False
        engine.close()
    return Counter(counter.glue), Counter(counter.registry), Counter(counter.inside)


def per_step(model, counter: GlueCounter, batch: int, context: int, steps: int):
    """(glue, registry, inside) per decode step: a run with `steps` more tokens minus the shorter run, over `steps`
    (after one untimed run: first calls build device-side tables once)."""
    count(model, counter, batch, context, 2)
    g0, r0, i0 = count(model, counter, batch, context, 2)
    g1, r1, i1 = count(model, counter, batch, context, 2 + steps)

    def diff(a, b):
        return {k: (b[k] - a[k]) / steps for k in b if b[k] != a[k]}
    return diff(g0, g1), diff(r0, r1), diff(i0, i1)


def narrow40(device: str):
    """The released 40-layer pattern (synthetic.FLASH_FULL's ratios, sources, Engram layers) at the embedded
    model's width: the same Python, so the same ops per layer, in a CPU's memory."""
    from deepinfer.models import synthetic
    from deepinfer.models.config import ModelConfig
    from deepinfer.models.engram import engram_table_rows
    from deepinfer.models.tiny import TEXT_CONFIG

    keys = ("num_hidden_layers", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
            "candidate_source_layer_id", "engram_layer_ids")
    text = dict(TEXT_CONFIG, **{k: synthetic.FLASH_FULL[k] for k in keys})
    text["engram_num_embeddings"] = engram_table_rows(text["engram_vocab_size"], len(text["engram_layer_ids"]),
                                                      text["engram_max_ngram_size"], text["engram_n_heads"])
    return synthetic.build_model(ModelConfig.from_dict(text), device, torch.float32, share_layers=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "narrow40", "flash", "flash40"),
                    help="narrow40: FLASH_FULL's 40-layer pattern at the embedded model's width (CPU); flash / "
                         "flash40: Flash width, for a GPU (--device cuda; graphs off, so every op is seen)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=20, help="source lines to list")
    ap.add_argument("--inside", action="store_true", help="also list the torch ops issued inside registry ops, "
                    "by op kind (on CUDA: the kernel wrappers' own copies, e.g. .contiguous() and .float())")
    args = ap.parse_args(argv)
    from decode_gpu import build

    if args.model == "narrow40":
        model = narrow40(args.device)
    else:
        model = build(args.model, args.device,
                      None if args.device == "cpu" else {"default": ["tilelang-sm90", "torch"]})
    counter = GlueCounter()
    counter.wrap(model.ops)
    layers = model.config.num_hidden_layers
    with counter:
        for b in args.batch:
            glue, reg, inside = per_step(model, counter, b, args.context, args.steps)
            n_glue, n_reg = sum(glue.values()), sum(reg.values())
            print(f"B={b}: per decode step {n_reg:.0f} registry op calls + {n_glue:.0f} glue torch ops "
                  f"({(n_reg + n_glue) / layers:.1f} per layer over {layers} layers)")
            by_line = Counter()
            names: dict[str, Counter] = {}
            for (line, name), n in glue.items():
                by_line[line] += n
                names.setdefault(line, Counter())[name] += n
            for line, n in by_line.most_common(args.top):
                ops = ", ".join(f"{k} x{v:g}" for k, v in names[line].most_common(4))
                print(f"  {n:7.1f}  {line:48s} {ops}")
            print("  op calls: " + ", ".join(f"{k} x{v:g}" for k, v in Counter(reg).most_common()))
            if args.inside:
                print("  torch ops inside the op calls (on CUDA: the wrappers' copies and tables beside their "
                      "kernels; on the CPU: the torch ops themselves):")
                for (kind, name), n in Counter(inside).most_common(args.top):
                    print(f"  {n:7.1f}  {kind:24s} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
