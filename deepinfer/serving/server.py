"""`python -m deepinfer serve=openai`: load the model's tokenizer and limits, start the engine core, serve HTTP
until SIGTERM / Ctrl-C, then stop the engine (its process is reaped) and close the socket.

The engine is built before the socket opens, so a model or config error ends the command with one line and exit
code 2 (the CLI's handling) instead of a server that answers 503 forever.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

log = logging.getLogger("deepinfer.serving")

DEFAULT_MODEL_NAME = "DeepSeek-V4.1-Flash"


def build_state(settings):
    """(ServerState, AsyncEngine) for resolved Settings; the engine core is started (not yet pumping)."""
    from deepinfer.engine.make_client import make_client
    from deepinfer.engine.options import EngineOptions
    from deepinfer.pipeline import load_program
    from deepinfer.serving.app import ServerState
    from deepinfer.frontend.async_engine import AsyncEngine
    from deepinfer.serving.convert import Converter
    from deepinfer.serving.metrics import ServerMetrics

    # the frontend needs the tokenizer and the model's limits (no weights); the engine core builds the model
    program, settings = load_program(settings, weights=False)
    options = EngineOptions.for_settings(settings)  # decoding too: DSpark and the rollback rows
    client = make_client(settings, options)
    tokenizer = program.tokenize.tokenizer
    metrics = ServerMetrics()
    engine = AsyncEngine(client, seed=options.seed, on_outputs=metrics.on_engine_outputs, tokenizer=tokenizer)
    serve = settings.serve
    name = serve.served_model_name or DEFAULT_MODEL_NAME
    info = client.info
    state = ServerState(
        engine=engine,
        converter=Converter(tokenizer, tokenizer.to_str(), info.max_model_len, name, serve.default_thinking),
        metrics=metrics,
        max_in_flight=settings.engine.max_num_seqs + serve.max_queued_requests,
        served_name=name,
        max_model_len=info.max_model_len,
    )
    return state, engine


def serve(settings) -> None:
    """Serves until SIGTERM / SIGINT. The engine core is closed on every way out."""
    from deepinfer.serving.app import build_app

    state, engine = build_state(settings)
    try:
        app = build_app(state)
        cfg = settings.serve
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
                                timeout_graceful_shutdown=cfg.shutdown_timeout, lifespan="on")
        server = _Server(config)
        _announce_when_bound(server, cfg.host, state.served_name)
        server.run()  # installs SIGINT/SIGTERM handlers; returns after a graceful shutdown
    finally:
        engine.close()
    print("deepinfer: server stopped", file=sys.stderr, flush=True)


class _Server(uvicorn.Server):
    """uvicorn's Server without re-raising the captured SIGTERM / SIGINT after its graceful shutdown (that would kill
    the process before the engine core is closed): serve() returns, closes the engine, and the command exits 0."""

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


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
