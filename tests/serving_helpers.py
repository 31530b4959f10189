"""A DeepInfer server on the embedded model, in this process on a background thread (loopback, a free port), with
the engine core in-process so tests can look at its cache manager."""

from __future__ import annotations

import resource
import threading
import time

import uvicorn

from deepinfer.api import load_settings
from deepinfer.serving.app import build_app
from deepinfer.serving.server import build_state, http_config

MODEL = "deepinfer-embedded-tiny"  # the embedded model's served name (serving.server.model_identity)


class ThreadServer:
    def __init__(self, overrides: list[str] = ()):
        settings = load_settings(["serve=openai", "serve.port=0", "engine.process=inproc", "runtime.seed=0",
                                  "cache.memory_budget=134217728", *overrides])
        self.state, self.engine = build_state(settings)
        # the server's own uvicorn settings (connection cap, head timeout), no signal handlers (a thread)
        file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        config = http_config(build_app(self.state), settings.serve, self.state.metrics.connections, file_limit,
                             host="127.0.0.1", port=0)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def call(self, fn, *args, timeout: float = 30.0):
        """Runs fn(*args) on the server's event loop and returns its result (for lifecycle tests)."""
        import asyncio

        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.state.loop).result(timeout)

    @property
    def cache(self):
        return self.engine.client.core.cache

    def idle(self, timeout: float = 30.0) -> bool:
        """True once no request is in flight and the engine holds no cache block or slot."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            c = self.cache
            # a held slot always holds a block: the scheduler reserves at least one token
            if self.engine.num_in_flight == 0 and c.num_used_blocks == 0 and not self.engine.client.core.has_work():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.engine.close()


def openai_client(server, timeout: float = 60):
    """The official `openai` client for `server`, no retries (a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=timeout)


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Polls `condition` until it holds (a refused or reset HTTP call counts as not yet) or `timeout` passes."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (Linux /proc)."""
    return _status_bytes(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int:
    """A process's highest resident memory so far (Linux /proc)."""
    return _status_bytes(pid, "VmHWM")
