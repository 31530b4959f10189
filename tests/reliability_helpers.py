"""Backends the reliability tests start an engine-core process with (deepinfer.engine.ImportedBackend: importable
there through PYTHONPATH)."""

from __future__ import annotations

import time


def stalling_backend(model: str):
    """The real model, except that every forward blocks for an hour: a step loop stuck in a call that never
    returns, while the rest of the process (its heartbeat thread) runs on."""
    from deepinfer.engine import ModelDirBackend

    backend = ModelDirBackend(model)()

    def stall(batch):
        time.sleep(3600)

    backend.prefill = backend.decode = stall
    return backend
