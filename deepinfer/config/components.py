"""Registry of pipeline components: (stage kind, name) -> factory, with the kernel backends and devices each
supports. A factory is a Hydra config object, {"_target_": "module.function", "_partial_": True}, instantiated
by `hydra.utils.instantiate` (no loader of our own) only when a pipeline picks it, so registering a GPU-only
component costs a CPU machine nothing.

It is the config's: the resolve step checks every `pipeline.stages.*.component` against it, and the config floor
imports nothing above it, so the catalogue (names and strings only) lives here; the builder
(deepinfer.pipeline.build) imports the factory a pipeline picks.

`Component.load(options)` instantiates the factory with the stage's options (pipeline.stages.NAME.options) as
keyword arguments; the partial it returns is called as factory(model, sampler) and gives the stage's
implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

ANY_BACKEND = "*"  # a host-side component that runs whatever kernels the model uses


@dataclass(frozen=True)
class Component:
    kind: str  # the stage it can back: tokenize | prefill | replay | decode | sample
    name: str
    backends: tuple[str, ...]  # op backends it works with (ANY_BACKEND: host side, indifferent)
    devices: tuple[str, ...]  # torch device types it can serve
    factory: dict[str, Any] = field(hash=False)  # {"_target_": "module.function", "_partial_": True}
    doc: str = ""

    def load(self, options: dict | None = None) -> Callable:
        """The factory with the stage's options bound (Hydra's instantiate, _partial_): call it (model, sampler)."""
        from hydra.utils import instantiate

        return instantiate(self.factory, **(options or {}))

    def option_names(self) -> list[str]:
        """The options the factory takes (its keyword parameters after model and sampler)."""
        import inspect

        from hydra.utils import get_method

        params = list(inspect.signature(get_method(self.factory["_target_"])).parameters)
        return params[2:]

    def supports(self, backend: str) -> bool:
        return ANY_BACKEND in self.backends or backend in self.backends


class Registry:
    def __init__(self) -> None:
        self._items: dict[tuple[str, str], Component] = {}

    def register(self, kind, name, *, backends, devices, target, doc="") -> None:
        """target: the factory's dotted import path ("module.function"), stored as Hydra's {_target_, _partial_}."""
        key = (kind, name)
        if key in self._items:
            raise ValueError(f"component {kind}/{name} is registered twice")
        factory = {"_target_": target, "_partial_": True, "_convert_": "all"}  # options reach it as plain values
        self._items[key] = Component(kind, name, tuple(backends), tuple(devices), factory, doc)

    def get(self, kind: str, name: str) -> Component:
        try:
            return self._items[(kind, name)]
        except KeyError:
            raise KeyError(f"no {kind} component {name!r}; registered: {', '.join(self.names(kind)) or 'none'}")

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self._items

    def names(self, kind: str) -> list[str]:
        return sorted(n for k, n in self._items if k == kind)

    def all(self) -> list[Component]:
        return [self._items[k] for k in sorted(self._items)]


REGISTRY = Registry()
_HERE = "deepinfer.pipeline.components"
_ALL_DEVICES = ("cpu", "cuda", "npu")
REGISTRY.register(
    "tokenize", "hf_tokenizer", backends=[ANY_BACKEND], devices=_ALL_DEVICES,
    target=f"{_HERE}.hf_tokenizer", doc="the checkpoint's tokenizer.json (tokenizers); prompt validation",
)
for _stage in ("prefill", "decode"):
    REGISTRY.register(
        _stage, "model_forward", backends=["torch", "tilelang-sm90"], devices=_ALL_DEVICES,
        target=f"{_HERE}.model_forward",
        doc="the model's own step over a packed ForwardBatch (models/step.py: the metadata, then model.run)",
    )
for _mode in ("mask", "compact"):
    REGISTRY.register(
        "replay", f"yoco_{_mode}", backends=["torch", "tilelang-sm90"], devices=_ALL_DEVICES,
        target=f"{_HERE}.yoco_{_mode}", doc=f"YOCO bounded replay, {_mode} mode (deepinfer/models/replay.py)",
    )
REGISTRY.register(
    "sample", "sampler", backends=[ANY_BACKEND], devices=_ALL_DEVICES,
    target=f"{_HERE}.sampler", doc="deepinfer.sampling.Sampler (penalties, top-k/p, min-p, grammar, seeds)",
)
