"""Build every kernel the given kernel manifests list (benchmarks/jit/*.jsonl), in parallel, into TileLang's disk
cache: a fresh GPU machine's compile work done once, on all its cores, before processes that would each build the
kernels they meet one at a time (the GPU test files: a pytest worker compiles as its tests first call a kernel).

    python3 benchmarks/jit_warm.py benchmarks/jit/flash40.jsonl [more.jsonl ...] [--out $OUT/jit_warm.json]

The manifests are merged (each line once) into the file DEEPINFER_JIT_MANIFEST names if set (so what later
processes compile is recorded there), else a temporary one. Exit 1 when a line is stale (its builder gone) or a
listed kernel fails to build: a warm-up that silently builds less than it lists would leave the compile time in the
runs it was meant to spare. Exit 2 on a bad argument or without a GPU.
"""

import argparse
import json
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifests", nargs="+", help="kernel manifest files (JSON lines)")
    ap.add_argument("--out", help="write the counts as JSON here")
    a = ap.parse_args(argv)
    missing = [m for m in a.manifests if not os.path.isfile(m)]
    if missing:
        ap.error(f"manifests: no such file: {', '.join(missing)}")
    import torch

    if not torch.cuda.is_available():
        ap.error("a GPU is needed: the kernels are compiled for the current device's architecture")
    lines = list(dict.fromkeys(line.strip() for m in a.manifests for line in open(m) if line.strip()))
    path = os.environ.get("DEEPINFER_JIT_MANIFEST", "").strip()
    if not path:
        path = os.path.join(tempfile.mkdtemp(), "jit.jsonl")
        os.environ["DEEPINFER_JIT_MANIFEST"] = path
    known = set()
    if os.path.isfile(path):
        known = {line.strip() for line in open(path) if line.strip()}
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines if line not in known)
    from deepinfer.kernels.tilelang import _build

    t0 = time.time()
    counts = _build.build_manifest()
    stats = _build.jit_stats()
    out = dict(manifests=a.manifests, manifest=counts, compiled=stats["compiled"], cache_hits=stats["cache_hits"],
               wall_s=time.time() - t0, gpu=torch.cuda.get_device_name(), targets=[])
    print(f"jit_warm: {counts['listed']} kernels listed ({counts['stale']} stale lines, {counts['failed']} failed), "
          f"{stats['compiled']} compiled, {stats['cache_hits']} from the disk cache, {out['wall_s']:.0f} s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    if counts["stale"] or counts["failed"] or not counts["listed"]:
        print("jit_warm: FAILED: the manifests list kernels the current code does not build", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
