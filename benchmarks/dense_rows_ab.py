#!/usr/bin/env python3
"""Runs another benchmark script with the FP8 projections' dequantise-for-cuBLAS crossover
(kernels/tilelang/linear.py `dense_rows`) at one row count for every weight of DENSE_MIN_N rows or more, for
A/B runs of that policy:

    source benchmarks/gpu_env.sh
    for r in 128 1024; do python3 benchmarks/dense_rows_ab.py $r benchmarks/dspark_gpu.py --model flash40 \\
        --batches 64 --accepted 0 2 --varlen --out $OUT/dspark_dense$r.json; done

(The seventeenth session's A/B, `benchmarks/results/*_s17_dense{128,1024}*`, ran on code whose policy was one
constant, linear.DENSE_ROWS, for every weight of >= DENSE_MIN_N rows; this wrapper sets the same on today's.)
"""

import os
import runpy
import sys

if len(sys.argv) < 3 or not sys.argv[1].isdigit():
    print("usage: dense_rows_ab.py ROWS SCRIPT [ARGS...]", file=sys.stderr)
    sys.exit(2)
from deepinfer.kernels.tilelang import linear  # noqa: E402

rows = int(sys.argv[1])
linear.dense_rows = lambda n_rows, k_dim: rows
print(f"linear.dense_rows = {rows} for every weight of >= {linear.DENSE_MIN_N} rows", flush=True)
script = sys.argv[2]
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
