#!/usr/bin/env python3
"""Runs another benchmark script with module-level integer constants overridden, for same-machine A/B runs of a
policy constant (each override is printed first; a malformed override or an unknown module or name is a one-line
error, exit 2):

    source benchmarks/gpu_env.sh
    python3 benchmarks/with_attrs.py deepinfer.kernels.tilelang.linear.TILE_COUNTERS=0 -- \\
        benchmarks/decode_gpu.py --model flash40 --batches 1 8 64 --contexts 4096 --variants graphs --prefill
    for r in 128 1024; do python3 benchmarks/with_attrs.py deepinfer.kernels.tilelang.linear.DENSE_ROWS=$r \\
        deepinfer.kernels.tilelang.linear.DENSE_ROWS_LARGE=$r -- benchmarks/dspark_gpu.py --model flash40 \\
        --batches 64 --accepted 0 2 --varlen --out $OUT/dspark_dense$r.json; done
"""

import importlib
import os
import runpy
import sys


def fail(line: str) -> None:
    print(line, file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        fail("usage: with_attrs.py MODULE.NAME=INT [...] -- SCRIPT [ARGS...]")
    cut = argv.index("--")
    for item in argv[:cut]:
        path, _, value = item.partition("=")
        mod_name, _, name = path.rpartition(".")
        try:
            number = int(value)
            mod = importlib.import_module(mod_name)
        except (ValueError, ImportError) as exc:
            fail(f"with_attrs.py: {item!r}: want MODULE.NAME=INT with an importable module ({exc})")
        if not isinstance(getattr(mod, name, None), int):
            fail(f"with_attrs.py: {path} is not an integer constant of {mod_name}")
        setattr(mod, name, number)
        print(f"{path} = {number}", flush=True)
    script = argv[cut + 1]
    sys.argv = argv[cut + 1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
