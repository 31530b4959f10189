"""Batch-invariant elementwise transcendentals.

torch's CPU kernels evaluate sigmoid/exp/cos/... with SIMD code and fall back to scalar code for a
tail of leftover elements; the two differ in the last ulp. Which elements land in the tail depends
on the tensor's total size, so a row's value would depend on its batch. Here the input is flattened
and padded to whole SIMD blocks (and split into chunks small enough to stay on one thread), so every
element takes the SIMD path and its result is a function of its value alone."""

import torch

_BLOCK = 64  # a multiple of every SIMD width x unroll torch uses for float32
_CHUNK = 16384  # below torch's parallel grain size: one thread, no per-thread tails


def ew(fn, x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % _BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if flat.numel() <= _CHUNK:
        out = fn(flat)
    else:
        out = torch.cat([fn(c) for c in flat.split(_CHUNK)])
    return out[:n].view(x.shape)
