#!/usr/bin/env python3
"""The TileLang row-wise kernels (deepinfer/kernels/tilelang/rowwise.py) at one decode token, next to the torch
reference op on the same GPU: microseconds per call from CUDA events over 200 calls, host launch cost included.
Their exactness is tested in tests/gpu/test_tilelang_rowwise.py.

    python3 benchmarks/rowwise_gpu.py
"""

import torch

from deepinfer.kernels.tilelang import rowwise
from deepinfer.kernels.torch import norm as ref_norm
from deepinfer.kernels.torch import quant as ref_quant
from deepinfer.kernels.torch import rope as ref_rope


def us_per_call(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, 5120, generator=g).bfloat16().cuda()
    w = torch.randn(5120, generator=g).bfloat16().cuda()
    q = torch.randn(1, 64, 512, generator=g).bfloat16().cuda()
    kv = torch.randn(1, 512, generator=g).bfloat16().cuda()
    pos = torch.tensor([1234], device="cuda")
    inv_freq = ref_rope.default_inv_freq(10000.0, 64).cuda()
    cases = {
        "rms_norm [1, 5120]": (lambda: rowwise.rms_norm(h, w, 1e-6), lambda: ref_norm.rms_norm(h, w, 1e-6)),
        "rope [1, 64, 512]": (lambda: rowwise.rope(q, pos, inv_freq), lambda: ref_rope.rope(q, pos, inv_freq)),
        "fake_quant_fp8 [1, 512]": (lambda: rowwise.fake_quant_fp8(kv), lambda: ref_quant.fake_quant_fp8(kv)),
        "fake_quant_fp4 e4m3 [1, 512]": (lambda: rowwise.fake_quant_fp4(kv, 16, True),
                                         lambda: ref_quant.fake_quant_fp4(kv, 16, True)),
    }
    print(f"{torch.cuda.get_device_name()}: one decode token, us per call")
    for name, (kern, ref) in cases.items():
        print(f"{name}: kernel {us_per_call(kern):.1f} us, torch {us_per_call(ref):.1f} us")


if __name__ == "__main__":
    main()
