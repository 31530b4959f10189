"""`python -m deepinfer serve=openai`: bind the port, load the model's tokenizer and limits, start the engine core,
serve HTTP until SIGTERM / Ctrl-C, drain, then stop the engine (its process is reaped) and close the socket.

The open-file limit is raised to its hard value and the port is bound first (a port in use costs one line and exit
code 2 before the model loads), then the engine is
built before anything is served, so a model or config error also ends the command with one line and exit code 2
(the CLI's handling) instead of a server that answers 503 forever. The first SIGTERM / Ctrl-C drains
(serving/lifecycle.py: new requests 503, open ones get serve.shutdown_timeout seconds); a second one stops at once.
With serve.exit_on_engine_death (the default) the server also stops when its engine core dies or hangs, and the
command exits with code 1 after one line, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn

log = logging.getLogger("deepinfer.serving")

EMBEDDED_PREFIX = "embedded:"
# the DeepSeek API's names, accepted only when the loaded model is that model (its directory or hub id's last part
# names it, a released suffix such as "-1017" allowed)
DEEPSEEK_API_NAMES = ("DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro")
EXIT_ENGINE_DIED = 1  # serve.exit_on_engine_death: the engine core died or hung
WATCH_S = 1.0  # the engine watcher's wake-up when nothing happens (the engine loop wakes it at once otherwise)


def model_identity(model_path: str) -> str:
    """The loaded model's own name: the hub id as given, a local directory's name, or `deepinfer-embedded-NAME`
    for an embedded model (a 3.5M-parameter model must not pass for the DeepSeek model it imitates)."""
    import os

    if model_path.startswith(EMBEDDED_PREFIX):
        return f"deepinfer-embedded-{model_path[len(EMBEDDED_PREFIX):]}"
    if os.path.isdir(model_path) or model_path.startswith(("/", ".", "~")):
        return os.path.basename(os.path.normpath(os.path.expanduser(model_path))) or model_path
    return model_path  # a hub id: vLLM's default served name


def deepseek_api_name(identity: str) -> str | None:
    """The DeepSeek API name of the loaded model (None for any other model)."""
    last = identity.rsplit("/", 1)[-1].lower()
    for name in DEEPSEEK_API_NAMES:
        if last == name.lower() or (last.startswith(name.lower() + "-") and last[len(name) + 1:].isdigit()):
            return name
    return None


def served_names(settings) -> list[str]:
    """serve.served_model_name (a name or a list of aliases; vLLM's --served-model-name), else the model's
    identity; the DeepSeek API's name of the loaded model is accepted too."""
    configured = settings.serve.served_model_name
    if isinstance(configured, str):
        names = [n for n in configured.replace(",", " ").split() if n]
    else:
        names = [str(n) for n in (configured or ())]
    identity = model_identity(settings.model.path)
    names = names or [identity]
    api = deepseek_api_name(identity)
    if api is not None and api not in names:
        names.append(api)
    return names


def default_thinking(settings) -> bool:
    """serve.default_thinking, or (null) what suits the loaded model: off for an embedded model (too small to
    reason: its whole answer would land in reasoning_content), on for a DeepSeek checkpoint."""
    value = settings.serve.default_thinking
    if value is not None:
        return bool(value)
    return not settings.model.path.startswith(EMBEDDED_PREFIX)


def converter_for(settings, tokenizer, max_model_len: int, vision=None):
    """The request converter (deepseek_recipe rendering) for resolved Settings, as the server builds it: its served
    names, default thinking mode and the prompt format of the loaded model. LLM.chat renders through it too.
    settings: as configured (model.path before the loader resolves it). vision: the model's vision path (image
    parts become spans), None for a text model."""
    import deepseek_recipe as dr

    from deepinfer.serving.convert import Converter

    names, thinking = served_names(settings), default_thinking(settings)
    version = dr.ModelVersion.DeepseekV4Pro if "DeepSeek-V4-Pro" in names else dr.ModelVersion.DeepseekV41Flash
    limits = (settings.sampling.xgrammar_max_schema_bytes, settings.sampling.xgrammar_max_schema_values)
    return Converter(tokenizer, tokenizer.to_str(), max_model_len, names, thinking, version, vision=vision,
                     schema_limits=limits)


def build_state(settings):
    """(ServerState, AsyncEngine) for resolved Settings; the engine core is started (not yet pumping)."""
    from deepinfer.engine.make_client import make_client
    from deepinfer.engine.options import EngineOptions
    from deepinfer.pipeline import load_program
    from deepinfer.frontend.async_engine import AsyncEngine
    from deepinfer.serving.app import ServerState
    from deepinfer.serving.guard import GuardSettings
    from deepinfer.serving.metrics import ServerMetrics

    names = served_names(settings)  # model.path as configured
    configured = settings
    # the frontend needs the tokenizer and the model's limits (no weights); the engine core builds the model
    program, settings = load_program(settings, weights=False)
    options = EngineOptions.for_settings(settings)  # decoding too: DSpark and the rollback rows
    client = make_client(settings, options)
    tokenizer = program.tokenize.tokenizer
    metrics = ServerMetrics(names[0], client.info.max_model_len)
    engine = AsyncEngine(client, seed=options.seed, on_outputs=metrics.on_engine_outputs, tokenizer=tokenizer)
    serve = settings.serve
    info = client.info
    state = ServerState(
        engine=engine,
        converter=converter_for(configured, tokenizer, info.max_model_len, getattr(program.model, "vision", None)),
        metrics=metrics,
        max_in_flight=settings.engine.max_num_seqs + serve.max_queued_requests,
        served_name=names[0],
        max_model_len=info.max_model_len,
        api_key=serve.api_key or None,
        shutdown_timeout=serve.shutdown_timeout,
        guard=GuardSettings.from_serve(serve),
    )
    return state, engine


def http_config(app, serve, counters, file_limit: int, **extra) -> uvicorn.Config:
    """uvicorn's configuration for the server's settings: the connection cap and head timeout
    (serving/connections.py), the idle keep-alive timeout, the log level. extra: more uvicorn.Config keys."""
    from deepinfer.serving.connections import connection_cap, guarded_protocol
    from deepinfer.serving.lifecycle import FINAL_WRITE_S

    cap = connection_cap(serve.max_connections, file_limit)
    return uvicorn.Config(app, http=guarded_protocol(cap, serve.header_timeout, counters), log_level=serve.log_level,
                          access_log=False, lifespan="on", timeout_keep_alive=serve.keep_alive_timeout,
                          timeout_graceful_shutdown=FINAL_WRITE_S, **extra)  # the drain has run by then


def serve(settings) -> None:
    """Serves until SIGTERM / SIGINT (exit 0), or until the engine core dies with serve.exit_on_engine_death
    (one line, exit code EXIT_ENGINE_DIED). The engine core is closed on every way out."""
    from deepinfer.serving.app import build_app
    from deepinfer.serving.auth import exposure_warning, host_warning
    from deepinfer.serving.connections import open_log_files, raise_open_file_limit
    from deepinfer.serving.lifecycle import bind

    cfg = settings.serve
    file_limit = raise_open_file_limit()
    sock = bind(cfg.host, cfg.port)  # before the model loads: a port in use is one line, exit 2
    try:
        for warning in (exposure_warning(cfg.host, cfg.api_key), host_warning(cfg.host, cfg.allowed_hosts)):
            if warning:
                print(f"deepinfer: warning: {warning}", file=sys.stderr, flush=True)
        state, engine = build_state(settings)
        try:
            app = build_app(state)
            config = http_config(app, cfg, state.metrics.connections, file_limit)
            server = _Server(config, state.drain, engine if cfg.exit_on_engine_death else None,
                             exit_grace=cfg.keep_alive_timeout)
            _announce_when_bound(server, cfg.host, state.served_name)
            open_log_files()  # logging must need no new file descriptor once clients hold them
            server.run(sockets=[sock])  # installs SIGINT/SIGTERM handlers; returns after the drain
        finally:
            engine.close()
    finally:
        sock.close()
    if server.engine_died is not None:
        print(f"deepinfer: error: the engine stopped ({server.engine_died}); the server exits "
              "(serve.exit_on_engine_death=true: a supervisor may restart it)", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ENGINE_DIED)
    print("deepinfer: server stopped", file=sys.stderr, flush=True)


class _Server(uvicorn.Server):
    """uvicorn's Server whose first SIGTERM / SIGINT drains (lifecycle.Drain) before uvicorn's own shutdown, and
    which does not re-raise the captured signal afterwards (that would kill the process before the engine core is
    closed): serve() returns, closes the engine, and the command exits 0. A second signal stops at once."""

    def __init__(self, config, drain, watched_engine=None, exit_grace: float = 0.0):
        """watched_engine: an AsyncEngine whose death stops the server (serve.exit_on_engine_death), or None.
        exit_grace: seconds the server answers 503 after that death before it stops (serve.keep_alive_timeout)."""
        super().__init__(config)
        self.drain = drain
        self.watched = watched_engine
        self.exit_grace = exit_grace
        self.engine_died: str | None = None
        self._loop = None
        self._watcher = None

    async def startup(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.watched is not None:
            self._watcher = self._loop.create_task(self._exit_when_engine_dies(), name="deepinfer-engine-watch")

    async def _exit_when_engine_dies(self):
        """The engine's death (detected by its client within engine.heartbeat_timeout, or at once when its process
        exits) stops the server; the requests in flight have been ended with a 503 / an error event by then. For
        exit_grace seconds first, new requests are answered 503 with `Connection: close` (app.py), and idle
        kept-alive connections reach uvicorn's keep-alive timeout, so the only connections left when uvicorn
        stops are ones opened in its last moments (a soak lost a request stopping at once: it was sent as its
        connection was closed)."""
        while self.watched.dead is None:
            await self.watched.wait_for_change(WATCH_S)
        self.engine_died = self.watched.dead
        await asyncio.sleep(self.exit_grace)
        self.should_exit = True

    def handle_exit(self, sig, frame):
        if self.drain.draining or self._loop is None or not self.started:
            self.should_exit = True
            self.force_exit = self.drain.draining
        else:  # a signal handler runs between two bytecodes of the loop's thread: hand the drain to the loop
            self._loop.call_soon_threadsafe(self.drain.begin, self._drained)
            print("deepinfer: draining (new requests get 503; Ctrl-C again to stop at once)", file=sys.stderr,
                  flush=True)

    def _drained(self):
        self.should_exit = True


def _announce_when_bound(server, host: str, name: str) -> None:
    """Prints the bound address once uvicorn listens (port 0 picks a free one: tests and scripts read this line)."""
    original = server.startup

    async def startup(sockets=None):
        await original(sockets=sockets)
        for s in server.servers:
            for sock in s.sockets:
                port = sock.getsockname()[1]
                print(f"deepinfer: serving {name} on http://{host}:{port}", file=sys.stderr, flush=True)
                return

    server.startup = startup
