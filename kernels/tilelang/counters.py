"""Arrival counters for kernels whose last block to finish completes a tile's work (the split FP8 GEMM's
reduction, the mHC mixes' finalize): each tile's last block reads the count, does the work and zeroes its
counter, so the set is all zero between launches, and launches in stream order may share it (under PDL too: a
kernel's griddepcontrol.wait is the whole previous grid). One set per device, made once: two such launches must
never run at once on two streams of a device. The side streams that run beside the main one (the MoE's and
expert parallelism's shared expert) launch neither kernel; CUDA-graph warm-ups and captures run on their own
streams but in order with the main one."""

import tilelang.language as T
import torch

# device code of the hand-over: the last block reads the other blocks' partials past L1 (.cg)
LD_CG_SOURCE = r"""
#ifndef DEEPINFER_SPLIT_ARRIVE
#define DEEPINFER_SPLIT_ARRIVE
__device__ __forceinline__ float di_ld_cg(const float* p) { return __ldcg(p); }
#endif
"""


@T.macro
def count_in(counters, tile, arrived, tx):
    """Every thread fences its partial stores, then thread 0 counts the block in on counters[tile]; arrived[0] (a
    shared int32) is then the count before this block's, the same for all of its threads. The block that reads
    (blocks per tile - 1) is the last: it fences again before reading the partials (CUDA's threadFenceReduction
    pattern) and zeroes counters[tile] when done."""
    T.call_extern("handle", "__threadfence")
    T.sync_threads()
    if tx == 0:
        arrived[0] = T.atomic_add(counters[tile], 1, return_prev=True)
    T.sync_threads()


TILE_COUNTERS = 1 << 16  # tiles one set covers (256 KB); the launchers take a two-launch path beyond

_COUNTERS: dict = {}


def tile_counters(device: torch.device) -> torch.Tensor:
    key = torch.device(device.type, device.index if device.index is not None or device.type != "cuda"
                       else torch.cuda.current_device())
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=key)
    return buf
