"""Turn one planned tensor into the dense tensor the model uses: read it row chunk by row chunk, dequantize,
and write into a preallocated output, so the peak is the output plus one chunk (not two copies of a 100 GB
Engram table)."""

from __future__ import annotations

import torch

from deepinfer.kernels.torch.quant import dequant_fp4_rows, dequant_fp8_blocks

from .errors import CheckpointError
from .plan import ROW_BLOCK, LoadItem
from .safetensors_reader import SafetensorsFiles
from .tensors import FLOAT, FP4_ROWS, FP8_BLOCK

CHUNK_ELEMENTS = 1 << 24  # ~64 MB of float32 temporaries per chunk


def materialize(
    files: SafetensorsFiles, item: LoadItem, dtype: torch.dtype, device: torch.device, block: tuple[int, int],
    pin_memory: bool = False,
) -> torch.Tensor:
    out = torch.empty(item.shape, dtype=dtype, device=device, pin_memory=pin_memory)
    if len(item.shape) < 2:
        out.copy_(files.rows(item.weight))
        _check_finite(item, out, 0)
        return out
    rows, cols = item.shape
    # FP8 block scales cover `block[0]` rows each, so chunk boundaries must fall on block boundaries.
    align = block[0] if item.kind == FP8_BLOCK else 1
    step = max(align, CHUNK_ELEMENTS // max(cols, 1) // align * align)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        out[start:stop].copy_(_chunk(files, item, start, stop, device, block))
        _check_finite(item, out[start:stop], start)
    return out


def _check_finite(item: LoadItem, values: torch.Tensor, first_row: int) -> None:
    """A NaN/Inf weight makes the model emit one token forever with NaN logprobs: refuse it, naming the tensor.
    Checked on the chunk just written (still in cache), after dequantization (a NaN scale shows up too), with
    aminmax: min and max propagate NaN and show an Inf, at ~2.7 ms per 16M float32 values (a copy of them: 12 ms;
    isfinite().all(): 90 ms). The exact, slower test runs only to say where."""
    if not values.is_floating_point() or values.numel() == 0:
        return
    low, high = torch.aminmax(values)
    if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
        bad = (~torch.isfinite(values)).nonzero()[0].tolist()
        bad[0] += first_row
        raise CheckpointError(f"tensor {item.name} holds a non-finite value (NaN or Inf) at {bad}; the checkpoint is corrupt")


def _chunk(files, item: LoadItem, start: int, stop: int, device, block) -> torch.Tensor:
    w = files.rows(item.weight, start, stop).to(device)
    if item.kind == FLOAT:
        return w
    if item.kind == FP8_BLOCK:
        s = files.rows(item.scale, start // block[0], -(-stop // block[0])).to(device)
        return dequant_fp8_blocks(w, s, block)
    s = files.rows(item.scale, start, stop).to(device)
    if item.kind == FP4_ROWS:
        return dequant_fp4_rows(w, s, ROW_BLOCK)
    # FP8_ROWS (Engram tables): a 1 x 32 block is exactly "per row, per 32 channels".
    return dequant_fp8_blocks(w, s, (1, ROW_BLOCK))
