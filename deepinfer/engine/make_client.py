"""Which client reaches the engine core, decided in one place for `LLM` (LLMEngine.for_settings) and the server:
in this process (engine.process=inproc: tests, debugging), one engine-core process (subprocess), or one engine core
per rank of a multi-rank layout with rank 0 driving the others (DataParallelClient)."""

from __future__ import annotations

from deepinfer.engine.options import EngineOptions


def make_client(settings, options: EngineOptions | None = None):
    """A started client for resolved Settings. options: the engine's (default: EngineOptions.for_settings). The
    core builds its backend from the settings (SettingsBackend, the one construction path), in this process
    (inproc) or its own; the frontend never builds the model."""
    from deepinfer.engine.backend import SettingsBackend

    options = options or EngineOptions.for_settings(settings)
    if settings.parallel.world_size > 1:  # the resolve step allows these only with engine.process=subprocess
        from deepinfer.engine.dp_client import DataParallelClient

        return DataParallelClient(SettingsBackend(settings), options, parallel=settings.parallel)
    return client_for(SettingsBackend(settings), options)


def client_for(factory, options: EngineOptions):
    """The client for one engine core built by `factory` (a zero-argument callable returning an EngineBackend), by
    options.process."""
    from deepinfer.engine.client import InprocClient, ProcessClient

    return (ProcessClient if options.process == "subprocess" else InprocClient)(factory, options)
