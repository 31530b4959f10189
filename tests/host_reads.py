"""A spy for host reads of tensor data: what would make a CUDA step wait for the device (a host sync), and what a
CUDA graph cannot capture. On the CPU there is no device to wait for, so the tests look for the operations instead:
`.item()` / `bool(t)` / `int(t)` (aten._local_scalar_dense, aten.is_nonzero), `.tolist()` / `.numpy()`, and the ops
whose output size depends on the data (nonzero, unique, masked_select, repeat_interleave by a tensor, bincount),
which read their input on the host on CUDA. `pause(fn)` wraps a function the spy does not look into (a registered
kernel op: on CUDA a TileLang kernel, captured by single's graphs already; a CPU-only check)."""

from __future__ import annotations

import functools
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive",
                 "unique_dim", "masked_select", "bincount", "equal")


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self._paused = 0
        self._saved = {}

    def _record(self, what: str) -> None:
        if not self._paused:
            frame = next((f for f in reversed(traceback.extract_stack()[:-2]) if "/deepinfer/" in f.filename), None)
            self.reads.append(f"{what} at {frame.filename.rsplit('/deepinfer/', 1)[-1]}:{frame.lineno}"
                              if frame else what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        sized_by_data = (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
                         and (kwargs or {}).get("output_size") is None)
        if name in HOST_READ_OPS or sized_by_data:
            self._record(f"aten.{name}.{func._overloadname}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for attr in ("tolist", "numpy"):
            original = getattr(torch.Tensor, attr)
            self._saved[attr] = original

            def spy(t, *a, _original=original, _attr=attr, **k):
                self._record(f"Tensor.{_attr}")
                return _original(t, *a, **k)

            setattr(torch.Tensor, attr, spy)
        return super().__enter__()

    def __exit__(self, *exc):
        for attr, original in self._saved.items():
            setattr(torch.Tensor, attr, original)
        return super().__exit__(*exc)

    def pause(self, fn):
        """fn, run without looking inside."""

        @functools.wraps(fn)
        def paused(*args, **kwargs):
            self._paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._paused -= 1

        return paused
