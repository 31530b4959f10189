#!/usr/bin/env python3
"""What DEEPINFER_BATCH_INVARIANT=1 costs on the GPU: decode step time and prefill time with the mode off and on,
from two runs of benchmarks/decode_gpu.py on the same machine (the mode is the process's, so one run each):

    source benchmarks/gpu_env.sh
    C="--batches 1 64 256 --contexts 4096 --variants graphs --prefill 8192 --steps 5 --warmup 2"
    python3 benchmarks/decode_gpu.py --model flash $C --out $OUT/off.json
    python3 benchmarks/decode_gpu.py --model flash $C --batch-invariant --out $OUT/on.json
    python3 benchmarks/batch_invariance_cost_gpu.py --off $OUT/off.json --on $OUT/on.json --out $OUT/cost.json

Rows: every cell both runs measured (decode: graphs, B x context; prefill: tokens), off / on time and the cost
(on / off - 1). Targets (issue 22): the mode costs <= 15% of the decode step at B=64 and <= 20% of prefill time."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import read_json  # noqa: E402

DECODE_B, DECODE_MAX, PREFILL_MAX = 64, 15.0, 20.0


def cells(path: str) -> tuple[dict, dict]:
    data = read_json(path)
    out = {}
    for r in data["rows"]:
        if r.get("mode") == "decode" and r.get("variant") == "graphs" and "step_ms" in r:
            out[("decode", r["batch"], r["context"])] = r["step_ms"]
        elif r.get("mode") == "prefill" and r.get("prefill_s"):
            out[("prefill", 1, r["tokens"])] = r["prefill_s"] * 1e3
    return data["meta"], out


def compare(off_path: str, on_path: str) -> dict:
    meta_off, off = cells(off_path)
    meta_on, on = cells(on_path)
    if meta_off.get("batch_invariant") or not meta_on.get("batch_invariant"):
        raise SystemExit(f"--off must be a run without --batch-invariant and --on one with it "
                         f"({off_path}: {meta_off.get('batch_invariant')}, {on_path}: {meta_on.get('batch_invariant')})")
    if meta_off.get("model") != meta_on.get("model"):
        raise SystemExit(f"the two runs measured different models: {meta_off.get('model')} vs {meta_on.get('model')}")
    rows, targets = [], []
    for key in sorted(set(off) & set(on)):
        mode, batch, size = key
        cost = (on[key] / off[key] - 1) * 100
        rows.append(dict(mode=mode, batch=batch, size=size, off_ms=off[key], on_ms=on[key], cost_pct=cost))
        limit = PREFILL_MAX if mode == "prefill" else DECODE_MAX if batch == DECODE_B else None
        if limit is not None:
            what = f"prefill of {size} tokens" if mode == "prefill" else f"decode step B={batch} ctx={size}"
            targets.append(dict(name=f"batch-invariant mode's cost, {what} ({meta_on['model']})",
                                measured=round(cost, 1), target=limit, unit="% over off", met=cost <= limit))
    if not targets:
        raise SystemExit("no cell that a target names was measured by both runs")
    return dict(model=meta_on["model"], gpu=meta_on.get("gpu"), off=off_path, on=on_path, off_cmd=meta_off.get("cmd"),
                on_cmd=meta_on.get("cmd"), targets=targets, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--off", required=True, help="decode_gpu.py JSON without --batch-invariant")
    ap.add_argument("--on", required=True, help="decode_gpu.py JSON with --batch-invariant")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    result = compare(a.off, a.on)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in result["rows"]:
        print(f"{r['mode']:7s} B={r['batch']:<4d} {r['size']:6d}: off {r['off_ms']:9.2f} ms  on {r['on_ms']:9.2f} ms "
              f"({r['cost_pct']:+5.1f}%)")
    for t in result["targets"]:
        print(f"target {t['name']}: {t['measured']}% (<= {t['target']}%) {'met' if t['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
