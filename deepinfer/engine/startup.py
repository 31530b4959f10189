"""The engine core's start-up messages: what the frontend writes on the child's stdin, as typed MessagePack (the
core's CoreStartup; a follower rank's RankStartup).

It names the backend by description (the resolved Settings: SettingsBackend, the one construction path), never as
a pickled callable,
so the core process runs only code that its own installation holds. Decoding checks every
field's type; the Settings are rebuilt through the config's own builder (deepinfer.config.resolve.rebuild), so
their ranges are checked again and nothing is resolved twice (hardware, memory: already concrete).
"""

from __future__ import annotations

from typing import Any

import msgspec

from deepinfer.engine.backend import SettingsBackend
from deepinfer.engine.options import EngineOptions


class _Spec(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    pass


class SettingsSpec(_Spec, tag="settings"):
    settings: dict[str, Any]  # msgspec.to_builtins(Settings)


BackendSpec = SettingsSpec  # the one description: the settings the core builds its backend from


class CoreStartup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: BackendSpec
    options: EngineOptions
    control: str  # ipc:// endpoints (deepinfer.engine.ipc.PrivateEndpoints)
    heartbeat: str
    key: bytes  # the channel's HMAC key
    parent_pid: int


def describe(factory) -> BackendSpec:
    """The typed description of a backend factory; TypeError (one line) for one that has none."""
    if isinstance(factory, SettingsBackend):
        return SettingsSpec(msgspec.to_builtins(factory.settings))
    raise TypeError(
        f"engine.process=subprocess starts the engine core from a typed description: SettingsBackend(settings); "
        f"got {type(factory).__name__} "
        f"(use engine.process=inproc for any other callable)"
    )


def factory_from(spec: BackendSpec):
    """The zero-argument factory the core builds its backend with."""
    from deepinfer.config.resolve import rebuild

    return SettingsBackend(rebuild(spec.settings))


def encode(startup: CoreStartup) -> bytes:
    return msgspec.msgpack.encode(startup)


def decode(data: bytes) -> CoreStartup:
    return msgspec.msgpack.decode(data, type=CoreStartup)


class RankStartup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A follower rank's start-up message (`python -m deepinfer.engine.core_process --follower`, started by
    deepinfer.engine.dp_client): it talks to no frontend socket, only to the other ranks' collectives."""

    settings: dict[str, Any]  # msgspec.to_builtins(Settings), rebuilt through the config's own checks
    options: EngineOptions


def encode_rank(settings, options: EngineOptions) -> bytes:
    return msgspec.msgpack.encode(RankStartup(msgspec.to_builtins(settings), options))


def decode_rank(data: bytes) -> RankStartup:
    return msgspec.msgpack.decode(data, type=RankStartup)
