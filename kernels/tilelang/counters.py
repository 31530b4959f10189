"""Arrival counters for kernels whose last block to finish completes a tile's work (the split FP8 GEMM's
reduction, the mHC mixes' finalize): each tile's last block reads the count, does the work and zeroes its
counter, so the set is all zero between launches, and launches in stream order may share it (under PDL too: a
kernel's griddepcontrol.wait is the whole previous grid). One set per device, made once: two such launches must
never run at once on two streams of a device. The side streams that run beside the main one (the MoE's and
expert parallelism's shared expert) launch neither kernel; CUDA-graph warm-ups and captures run on their own
streams but in order with the main one."""

import torch

TILE_COUNTERS = 1 << 16  # tiles one set covers (256 KB); the launchers take a two-launch path beyond

_COUNTERS: dict = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    key = torch.device(device.type, device.index if device.index is not None or device.type != "cuda"
                       else torch.cuda.current_device())
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=key)
    return buf
