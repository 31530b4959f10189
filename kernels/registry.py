"""Registry of kernel-backed ops: (kind, backend) -> lazily imported implementation.

The model is written against op *kinds* (`rms_norm`, `sink_attention`, `moe_experts`, ...). Each backend
module registers the kinds it implements and the devices it supports; `OpSet.build` picks, per kind,
the first backend of the hardware config's preference list that is registered and supports the
device, and records the choice (and any fallback) for the run summary. Implementations are imported
only when chosen, so a CPU machine never imports GPU code.

A chosen backend may still hand single calls to the torch op (inputs its kernels do not cover); every such call
goes through `fall_back`, which counts it per (kind, reason) for the run summary and logs each pair once, so no
op the summary attributes to a kernel backend runs on torch unnoticed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("deepinfer.kernels")

# Every op kind the model calls; the torch backend implements all of them.
OP_KINDS = (
    "linear",
    "grouped_linear",
    "rms_norm",
    "rope",
    "fake_quant_fp8",
    "fake_quant_fp4",
    "encode_fp8",
    "encode_fp4",
    "window_kv",
    "mhc_mixes",
    "mhc_collapse",
    "mhc_collapse_norm",
    "mhc_expand",
    "sink_attention",
    "sink_attention_decode",
    "compressor_pool",
    "indexer_scores",
    "indexer_scores_fp4",
    "index_topk_ids",
    "index_topk_rows",
    "moe_router",
    "moe_experts",
    "engram_hash",
    "engram_gate",
    "vision_attention",
)


class BackendError(RuntimeError):
    """No registered backend can run an op kind on this device."""


@dataclass(frozen=True)
class OpEntry:
    kind: str
    backend: str
    devices: tuple[str, ...]  # torch device types: "cpu", "cuda", "npu"
    target: str  # the implementation's dotted import path, "module.path.function" (Hydra's `_target_` form)

    def load(self) -> Callable:
        """The implementation, imported by the one loader the config uses for `_target_` (hydra.utils)."""
        from hydra.utils import get_method

        return get_method(self.target)


_REGISTRY: dict[tuple[str, str], OpEntry] = {}


def register(kind: str, backend: str, devices: tuple[str, ...], target: str) -> None:
    """target: "module.path.function", imported only when the op is chosen (OpEntry.load)."""
    if kind not in OP_KINDS:
        raise ValueError(f"unknown op kind {kind!r}; allowed: {', '.join(OP_KINDS)}")
    _REGISTRY[(kind, backend)] = OpEntry(kind, backend, tuple(devices), target)


def registered(kind: str | None = None) -> list[OpEntry]:
    _ensure_builtin()
    return [e for (k, _), e in sorted(_REGISTRY.items()) if kind is None or k == kind]


def backends_for(kind: str, device: str) -> list[str]:
    return [e.backend for e in registered(kind) if device in e.devices]


_BUILTIN_LOADED = False


def _ensure_builtin() -> None:
    """Backend modules declare their ops in small `ops.py` manifests (no kernel imports)."""
    global _BUILTIN_LOADED
    if _BUILTIN_LOADED:
        return
    _BUILTIN_LOADED = True
    for manifest in ("deepinfer.kernels.torch.manifest", "deepinfer.kernels.tilelang.manifest"):
        try:
            importlib.import_module(manifest)
        except ModuleNotFoundError as exc:
            if not manifest.startswith(exc.name or "?"):
                raise  # a manifest that exists but fails to import is a bug, not a missing backend


_MODE = {"batch_invariant": False}


def batch_invariant() -> bool:
    """Whether kernel launchers must give each row a result independent of the batch it runs in (fixed split
    counts, tile shapes and reduction orders instead of ones chosen by batch size); set by OpSet.build."""
    return _MODE["batch_invariant"]


_NO_HOST_READS = threading.local()


@contextlib.contextmanager
def no_host_reads():
    """Inside: kernel launchers take only paths that read nothing back to the host, the ones a CUDA graph capture
    takes (e.g. moe_experts never its grouped prefill path, which sizes its GEMMs from counts read on the host). For
    callers that must not sync even when not capturing: expert parallelism's static path over its mostly empty
    receive buffers, and a graph's warm-up, which must compile the kernels its capture will launch."""
    depth = getattr(_NO_HOST_READS, "depth", 0)
    _NO_HOST_READS.depth = depth + 1
    try:
        yield
    finally:
        _NO_HOST_READS.depth = depth


def host_reads_allowed() -> bool:
    """False inside no_host_reads() (this thread) and while the current CUDA stream is capturing a graph."""
    if getattr(_NO_HOST_READS, "depth", 0):
        return False
    import torch

    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


_FALLBACKS: Counter[tuple[str, str]] = Counter()
_FALLBACKS_LOCK = threading.Lock()


def fall_back(kind: str, reason: str, torch_op: Callable, *args, **kwargs):
    """Run `torch_op(*args, **kwargs)` for a kernel backend's `kind` whose kernels do not cover this call, and
    count it under `reason` (a short, shape-free phrase, so the counts stay a short list)."""
    key = (kind, reason)
    with _FALLBACKS_LOCK:
        _FALLBACKS[key] += 1
        first = _FALLBACKS[key] == 1
    if first:
        log.warning("kernel fallback per call: %s -> torch (%s); counted in the run summary", kind, reason)
    return torch_op(*args, **kwargs)


def fallback_counts() -> dict[str, dict[str, int]]:
    """kind -> reason -> calls that fell back to the torch op in this process so far."""
    with _FALLBACKS_LOCK:
        items = sorted(_FALLBACKS.items())
    out: dict[str, dict[str, int]] = {}
    for (kind, reason), n in items:
        out.setdefault(kind, {})[reason] = n
    return out


def kernel_stats() -> dict:
    """This process's per-call fallbacks and, once a TileLang kernel was requested, its JIT statistics (compiles,
    disk-cache hits, seconds). Cumulative since the process started: the engine core sends it with every step."""
    build = sys.modules.get("deepinfer.kernels.tilelang._build")  # not imported: nothing was compiled
    return {"fallbacks": fallback_counts(), "jit": build.jit_stats() if build is not None else None}


@dataclass
class OpSet:
    """Resolved implementations, one per op kind, plus what was chosen and why."""

    device: str
    chosen: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    batch_invariant: bool = False
    _fns: dict[str, Callable] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        device: str = "cpu",
        preference: dict[str, list[str]] | list[str] | None = None,
        strict: bool = False,
        batch_invariant: bool = False,
    ) -> "OpSet":
        """`preference` maps kind -> ordered backends (key `default` for the rest), or is one list for
        every kind. With `strict`, a preferred backend that is missing is an error instead of a
        logged fallback. `batch_invariant` switches the kernel launchers of this process to their
        batch-invariant choices (see batch_invariant(); the torch ops are row-invariant already)."""
        _ensure_builtin()
        _MODE["batch_invariant"] = bool(batch_invariant)
        ops = cls(device=device, batch_invariant=bool(batch_invariant))
        for kind in OP_KINDS:
            if isinstance(preference, dict):
                prefs = list(preference.get(kind, preference.get("default", ["torch"])))
            else:
                prefs = list(preference or ["torch"])
            available = backends_for(kind, device)
            pick = next((b for b in prefs if b in available), None)
            if pick is None:
                if strict or "torch" not in available:
                    raise BackendError(
                        f"op {kind!r}: none of the backends {prefs} is available on device {device!r}; "
                        f"registered here: {available or 'none'}"
                    )
                pick = "torch"
            if pick != prefs[0]:
                reason = f"{prefs[0]} unavailable on {device}, using {pick}"
                ops.fallbacks[kind] = reason
                log.warning("kernel fallback: %s: %s", kind, reason)
            ops.chosen[kind] = pick
            ops._fns[kind] = _REGISTRY[(kind, pick)].load()
        return ops

    def __getattr__(self, kind: str) -> Callable:
        fns = self.__dict__.get("_fns")
        if fns is not None and kind in fns:
            return fns[kind]
        raise AttributeError(kind)

    def fallback_counts(self) -> dict[str, dict[str, int]]:
        """Per-call fallbacks (kind -> reason -> calls) of the kinds this set runs on a non-torch backend."""
        return {k: v for k, v in fallback_counts().items() if self.chosen.get(k, "torch") != "torch"}

    def summary(self) -> dict[str, str]:
        """kind -> backend, "(fallback)" where the preferred backend was missing, and the calls that the chosen
        backend handed to the torch op."""
        calls = {k: sum(v.values()) for k, v in self.fallback_counts().items()}
        return {k: self.chosen[k] + (" (fallback)" if k in self.fallbacks else "")
                + (f" ({calls[k]} calls fell back to torch)" if k in calls else "") for k in OP_KINDS}
