"""Where DSpark verification goes non-finite: the benchmark's B=8 setting (decode_gpu.py's filled context, greedy,
the draft layers' own guesses) served once, every verification step's target logits checked for NaN / infinity.
On the 40-layer Flash model at B=8 on the H200 (2026-12-02) a whole step's logits went non-finite after ~21 tokens,
eager and graphed alike (docs/dspark.md); this prints, per run, the steps whose logits were not finite, which rows,
NaN and infinity counts, and the drafts being verified, to narrow the cause down. With --trace (graphs off only:
it reads every op's output on the host) every op call of the model is checked as it returns, and the first calls
whose floating-point inputs held no NaN but whose output did are printed: the op kind, its arguments'
shapes and dtypes, and how many verifications had run before it (the forward of verification n runs at n - 1).

The H200 runs of 2026-12-02 narrowed it to the last verification steps of a run, where the drafts are capped by
max_tokens (B = 4: 4 tokens a sequence; B = 8: 2), at B >= 4 with 16 rows: the decode attention kernel was given
8 key splits of 10 blocks, two of them past the last block (docs/dspark.md: found and fixed). Kept as the check:
    python3 tools/dspark_finite.py --model flash40 --graphs off --batch 4 --tokens 24 --context 1024 --trace
    (after the fix: "0 of 22 verifications non-finite")

    # H200 (device tool, carry [".devpack"]), from the repo root; ~1 min with a warm TileLang cache, 4 cold:
    source benchmarks/gpu_env.sh && python3 tools/dspark_finite.py --model flash40 --graphs on off
    python tools/dspark_finite.py --model tiny --context 256    # CPU smoke (tests/test_dspark_finite.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from decode_gpu import build, make_engine  # noqa: E402


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in x[:6]) + (", ..." if len(x) > 6 else "") + "]"
    return type(x).__name__ if hasattr(x, "__dict__") else repr(x)[:40]


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _no_nan(x) -> bool:
    return not any(bool(torch.isnan(t).any()) for t in _tensors(x) if t.is_floating_point())


def trace_ops(ops, step, found: list, most: int = 8):
    """Wraps every op of `ops` (kernels/registry.py OpSet): a call whose floating inputs hold no NaN and whose output
    does (the bad logits were NaN; -inf is a masked score's legitimate value) is recorded in `found`, the first
    `most` of them: its kind, arguments, and step[0] at the time (the verifications done before it: the forward
    that verification n checks runs at n - 1)."""
    def wrap(kind, fn):
        def traced(*args, **kwargs):
            out = fn(*args, **kwargs)
            if len(found) < most and not _no_nan(out) and _no_nan((args, kwargs)):
                found.append(dict(op=kind, step=step[0], args=[_describe(a) for a in args],
                                  kwargs={k: _describe(v) for k, v in kwargs.items()}))
            return out
        return traced

    for kind, fn in list(ops._fns.items()):
        ops._fns[kind] = wrap(kind, fn)


def serve(model, graphs: bool, batch: int, context: int, tokens: int, drafts: int, trace: bool = False) -> dict:
    """One generate with every verification's logits checked. Returns {"bad": [...], "errors": [...]}."""
    from deepinfer import SamplingParams

    g = torch.Generator().manual_seed(batch * 7919 + context)  # dspark_gpu.py's prompts
    prompts = torch.randint(3, 500, (batch, context), generator=g).tolist()
    engine, _, _ = make_engine(model, fill=True, max_seqs=batch, context=context, max_tokens=tokens + 8,
                               graphs=graphs, interval=8, batched_tokens=max(batch * (context + 1), 8192),
                               num_draft=drafts, seed=1, same_fill=True)
    sampler = engine.client.core.runner.backend.sampler
    inner, bad, seen, first = sampler.verify, [], [0], []
    if trace:
        trace_ops(model.ops, seen, first)

    def verify(logits, requests):
        seen[0] += 1
        broken = ~torch.isfinite(logits)
        if broken.any():
            rows = broken.any(-1).nonzero().flatten().tolist()
            bad.append(dict(step=seen[0], rows=len(rows), of=logits.shape[0], first_rows=rows[:8],
                            nan=int(logits.isnan().sum()), inf=int(logits.isinf().sum()),
                            drafts=[list(r.drafts) for r in requests][:4]))
        return inner(logits, requests)

    sampler.verify = verify
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                               use_tqdm=False)
    finally:
        engine.close()
    return dict(verifications=seen[0], bad=bad, errors=[o.error for o in outs if o.error], first=first)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("flash", "flash40", "tiny"), default="flash40")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--drafts", type=int, default=5)
    ap.add_argument("--graphs", choices=("on", "off"), nargs="+", default=["on"])
    ap.add_argument("--trace", action="store_true", help="check every op call's output (graphs off only)")
    a = ap.parse_args(argv)
    if a.trace and a.graphs != ["off"]:
        ap.error("--trace: reads each op's output on the host, which a CUDA graph's replay cannot: --graphs off")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from deepinfer.models import synthetic

    prefs = {"default": ["tilelang-sm90", "torch"]} if device == "cuda" else ["torch"]
    model = build(a.model, device, prefs, overrides=None if a.model == "tiny" else synthetic.DSPARK_FLASH)
    found = False
    for graphs in a.graphs:
        got = serve(model, graphs == "on" and device == "cuda", a.batch, a.context, a.tokens, a.drafts, a.trace)
        found |= bool(got["bad"])
        print(f"{a.model} B={a.batch} graphs {graphs}: {len(got['bad'])} of {got['verifications']} verifications "
              f"non-finite; {len(got['errors'])} requests ended with an error", flush=True)
        for b in got["bad"][:6]:
            print("   ", b, flush=True)
        for f in got["first"]:
            print("    first NaN from NaN-free inputs:", f, flush=True)
        if a.trace and got["bad"] and not got["first"]:
            print("    no op made a NaN from NaN-free inputs: it came from the code between the ops", flush=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
