"""Arrival counters for kernels whose last block to finish completes a tile's work (the split FP8 GEMM's
reduction, the mHC mixes' finalize): each tile's last block reads the count, does the work and zeroes its
counter, so the set is all zero between launches. One set per device and stream: launches of two streams in
flight at once must not count into one tile; launches of one stream are ordered (under PDL too: a kernel's
griddepcontrol.wait is the whole previous grid)."""

import torch

TILE_COUNTERS = 1 << 16  # tiles one set covers (256 KB); the launchers take a two-launch path beyond

_COUNTERS: dict = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return buf
