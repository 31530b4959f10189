"""Registry of kernel-backed ops: (kind, backend) -> lazily imported implementation.

The model is written against op *kinds* (`rms_norm`, `sink_attention`, `moe_experts`, ...). Each backend
module registers the kinds it implements and the devices it supports; `OpSet.build` picks, per kind,
the first backend of the hardware config's preference list that is registered and supports the
device, and records the choice (and any fallback) for the run summary. Implementations are imported
only when chosen, so a CPU machine never imports GPU code.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("deepinfer.kernels")

# Every op kind the model calls; the torch backend implements all of them.
OP_KINDS = (
    "linear",
    "rms_norm",
    "rope",
    "fake_quant_fp8",
    "fake_quant_fp4",
    "mhc_mixes",
    "mhc_collapse",
    "mhc_expand",
    "sink_attention",
    "compressor_pool",
    "indexer_scores",
    "index_topk",
    "moe_router",
    "moe_experts",
    "engram_hash",
    "engram_gate",
)


class BackendError(RuntimeError):
    """No registered backend can run an op kind on this device."""


@dataclass(frozen=True)
class OpEntry:
    kind: str
    backend: str
    devices: tuple[str, ...]  # torch device types: "cpu", "cuda", "npu"
    target: str  # "module.path:function"

    def load(self) -> Callable:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[tuple[str, str], OpEntry] = {}


def register(kind: str, backend: str, devices: tuple[str, ...], target: str) -> None:
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


@dataclass
class OpSet:
    """Resolved implementations, one per op kind, plus what was chosen and why."""

    device: str
    chosen: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    _fns: dict[str, Callable] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        device: str = "cpu",
        preference: dict[str, list[str]] | list[str] | None = None,
        strict: bool = False,
    ) -> "OpSet":
        """`preference` maps kind -> ordered backends (key `default` for the rest), or is one list for
        every kind. With `strict`, a preferred backend that is missing is an error instead of a
        logged fallback."""
        _ensure_builtin()
        ops = cls(device=device)
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

    def summary(self) -> dict[str, str]:
        return {k: self.chosen[k] + (" (fallback)" if k in self.fallbacks else "") for k in OP_KINDS}
