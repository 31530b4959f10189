#!/usr/bin/env python3
"""DSpark's Markov bias (deepinfer/models/dspark.py: logits + embed[prev] @ head.T in fp32, §6.3) from the bf16
[129280, 256] head as stored, one GEMM with fp32 output, against the fp32 copy of the head it replaced (twice the
bytes read): the time a call takes inside a CUDA graph (as the drafting graphs run it; wide_reduce_gpu.py's timing),
at the rows a drafting step has (its batch). Both are checked against the float64 product within fp32 summation
error (exit 1 if not).

    python3 benchmarks/markov_head_gpu.py [--rows 1 8 64] [--out benchmarks/results/markov_head_gpu.json]
"""

import sys

import torch

from wide_reduce_gpu import finish, gpu_args, graph_us

from deepinfer.kernels.torch.linear import linear

VOCAB, RANK, CALLS = 129280, 256, 20


def main(argv=None) -> int:
    a = gpu_args(__doc__, argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    head = torch.randn(VOCAB, RANK, device="cuda", generator=g).bfloat16()
    head32 = head.float()
    out = dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__, vocab=VOCAB, rank=RANK,
                         calls=CALLS), rows=[], targets=[])  # no issue names a target for this op
    wrong = []
    for n in a.rows:
        base = torch.randn(n, VOCAB, device="cuda", generator=g)
        inputs = [torch.randn(n, RANK, device="cuda", generator=g).bfloat16() for _ in range(CALLS)]
        arms = {"bf16 head, fp32 out": lambda e: base + linear(e, head, out_dtype=torch.float32),
                "fp32 head copy": lambda e: base + linear(e.float(), head32)}
        e = inputs[0]
        ref = base.double() + e.double() @ head.double().t()
        bound = RANK * 2.0 ** -24 * (base.double().abs() + e.double().abs() @ head.double().abs().t()) + 1e-30
        row = dict(rows=n, weight_mb={"bf16 head, fp32 out": VOCAB * RANK * 2 / 1e6,
                                      "fp32 head copy": VOCAB * RANK * 4 / 1e6})
        for name, fn in arms.items():
            if not ((fn(e).double() - ref).abs() <= bound).all():
                wrong.append(f"{name} rows={n}")
            row[name] = graph_us(fn, inputs)
        out["rows"].append(row)
        print(f"rows={n:3d}: bf16 head {row['bf16 head, fp32 out']:6.1f} us, fp32 copy {row['fp32 head copy']:6.1f} us "
              f"({row['fp32 head copy'] / row['bf16 head, fp32 out']:.2f}x)")
    return finish(out, wrong, a.out, "outside fp32 summation error")


if __name__ == "__main__":
    sys.exit(main())
