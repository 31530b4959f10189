"""Host values onto the device without a wait (the sample stage's parameters, and through
models.cache.metadata.to_device every step's metadata).

On CUDA a copy from pageable host memory (what `torch.tensor(values, device=...)` and `.to(device)` do) waits for
the stream to drain first: right after a step's graph replay that leaves the device idle while the host waits, and
the host loses its lead under async scheduling. A copy from pinned memory is queued in stream order instead."""

from __future__ import annotations

import torch


def queued(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device`: for CUDA a non-blocking copy from pinned memory, in stream order."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def queued_values(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), queued."""
    return queued(torch.tensor(values, dtype=dtype), device)
