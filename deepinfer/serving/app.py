"""The FastAPI app: routes, admission, streaming (SSE) and non-streaming responses.

Every route answers a bad request with its own one-line 4xx (never a 500, never touching other requests); a
request whose client goes away, streaming or not, is aborted in the engine so its cache is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.serving import auth
from deepinfer.serving.body import json_body
from deepinfer.serving.completions_shape import CompletionShaper
from deepinfer.serving.connections import install_loop_guard
from deepinfer.serving.errors import HTTPError, log_refusal, unconvertible
from deepinfer.serving.guard import Guard, GuardSettings
from deepinfer.serving.lifecycle import SHUTTING_DOWN, Drain
from deepinfer.serving.metrics import CONTENT_TYPE_LATEST
from deepinfer.serving.request_run import RequestRun
from deepinfer.serving.token_routes import add_token_routes

ROUTES = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages",
          "/v1/completions": "completions"}


@dataclass
class ServerState:
    engine: object  # deepinfer.frontend.AsyncEngine
    converter: object  # Converter
    metrics: object  # ServerMetrics
    max_in_flight: int  # engine.max_num_seqs + serve.max_queued_requests
    served_name: str
    max_model_len: int
    api_key: str | None = None  # serve.api_key: required on the guarded routes (serving/auth.py) when set
    shutdown_timeout: float = 5.0  # serve.shutdown_timeout: the drain's bound (serving/lifecycle.py)
    guard: GuardSettings | None = None  # host, origin, content type, body limits (serving/guard.py); None: off
    drain: Drain | None = None  # made by build_app
    loop: asyncio.AbstractEventLoop | None = None  # the serving event loop, once started


class ClientGone(Exception):
    pass


def build_app(state: ServerState) -> FastAPI:
    """The routes over `state`; with state.api_key set, wrapped in the API-key check; with state.guard set, in the
    host, origin, content-type and body checks of serving/guard.py (an ASGI app either way)."""
    state.drain = Drain(state.engine, state.shutdown_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        install_loop_guard(state.loop, state.metrics.connections)  # accept() out of descriptors never kills it
        state.engine.start(state.loop)  # the pump delivers to this loop
        yield

    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    started = int(time.time())

    @app.get("/health")
    async def health():
        problem = state.engine.health()
        if problem is not None:
            return JSONResponse({"status": "error", "error": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "deepinfer", "root": state.served_name,
                "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in state.converter.served_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        try:
            state.converter.check_model({"model": name})
        except HTTPError as exc:
            return JSONResponse(exc.body("models"), status_code=exc.status)
        return model_card(name)

    for path, endpoint in ROUTES.items():
        app.add_api_route(path, _handler(state, endpoint), methods=["POST"])
    add_token_routes(app, state)
    guarded = _RequireKey(app, state.api_key) if state.api_key else app
    if state.guard is not None:
        guarded = Guard(guarded, state.guard, state.metrics.connections)
    return _CloseWhileStopping(guarded, state)


class _CloseWhileStopping:
    """ASGI wrapper: while the server drains or its engine is dead, every response says `Connection: close`, so a
    client's kept-alive connections end with an answer (a 503) before the server stops, instead of being closed
    under a request sent on them as the server exits."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.router = getattr(app, "router", None)  # what tests and uvicorn may look at stays reachable

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def closing(message):
            if message["type"] == "http.response.start" and self._stopping():
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"connection"]
                message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)

    def _stopping(self) -> bool:
        drain = self.state.drain
        return (drain is not None and drain.draining) or self.state.engine.dead is not None


class _RequireKey:
    """ASGI wrapper: a guarded route without the API key is answered 401 in its protocol's shape (plain ASGI, not
    Starlette's BaseHTTPMiddleware, so streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key
        self.router = app.router  # what tests and uvicorn may look at stays reachable

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and auth.guarded(scope["path"]):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
            try:
                auth.check(self.key, headers)
            except HTTPError as exc:
                endpoint = "messages" if scope["path"].startswith("/v1/messages") else "chat"
                response = JSONResponse(exc.body(endpoint), status_code=exc.status,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _handler(state: ServerState, endpoint: str):
    async def handle(request: Request):
        runs: list = []
        try:
            body = await json_body(request)
            _admit(state)
            try:
                if endpoint == "completions":
                    prepared = state.converter.convert_completion(body)
                else:
                    prepared = state.converter.convert(endpoint, body)
            except (HTTPError, asyncio.CancelledError):
                raise
            except Exception as exc:  # the client's bytes, whatever the converter raised: never a 500
                raise unconvertible(exc, endpoint) from None
            runs = _submit(state, prepared, client_of(request))
            await _until_disconnect(request, _start_all(runs))
            headers = {"x-deepinfer-ignored-fields": ",".join(prepared.ignored)} if prepared.ignored else {}
            if prepared.stream:
                return StreamingResponse(_sse(state, runs, prepared), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
            return await _until_disconnect(request, _complete(state, runs, prepared, headers))
        except HTTPError as exc:
            log_refusal(request.method, request.url.path, exc)
            if not runs or exc.status != 400:
                state.metrics.on_rejected(exc.status)
            _close(runs)
            return JSONResponse(exc.body(endpoint), status_code=exc.status)
        except ClientGone:
            _close(runs)
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except BaseException:
            _close(runs)
            raise

    return handle


def client_of(request: Request) -> str:
    """Who a request is from, for the fair share of grammar compilations: the peer's address. Not the connection
    (HTTP/1.1 runs one request at a time on it, so a client wanting more opens more) and not the API key (one per
    server); behind a proxy every client is the proxy, and the per-client bound becomes a bound for all."""
    return request.client.host if request.client is not None and request.client.host else "unknown"


def _submit(state: ServerState, prepared, client: str = "unknown") -> list:
    """(RequestRun, Job) per engine request: every sample of every prompt, prompt-major."""
    runs = []
    for job in prepared.jobs:
        for stream in state.engine.submit_all(job.prompt_ids, job.params, job.images, job.cache_salt,
                                              client=client):
            processor = None
            if prepared.new_sample is not None:
                processor, response = prepared.new_sample()
            run = RequestRun(state.engine, stream, len(job.prompt_ids), state.metrics, processor,
                             prepared.token_logprobs, state.drain)
            if prepared.new_sample is not None:
                run.response = response
            runs.append((run, job))
    return runs


async def _start_all(runs) -> None:
    """Every run's start (each waits for its first update); the first refusal is raised once all have answered,
    so none is left with an exception nobody reads."""
    results = await asyncio.gather(*(run.start() for run, _ in runs), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


def _close(runs) -> None:
    for run, _ in runs:
        run.close()


def _admit(state: ServerState) -> None:
    if state.drain is not None and state.drain.draining:
        raise HTTPError(503, f"{SHUTTING_DOWN}; retry on another server", "service_unavailable")
    if state.engine.dead is not None:
        raise HTTPError(503, f"the engine is not serving: {state.engine.dead}", "service_unavailable")
    if state.engine.num_in_flight >= state.max_in_flight:
        raise HTTPError(429, f"the server is at capacity ({state.max_in_flight} requests in flight: "
                             "engine.max_num_seqs + serve.max_queued_requests); retry later", "rate_limit_exceeded")


async def _until_disconnect(request: Request, coro):
    """Runs `coro` unless the client disconnects first (then ClientGone): Starlette does not cancel a handler
    whose client left, so a queued or non-streaming request would otherwise run to the end for nobody."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merged(gens):
    """(i, item) from several async generators as the items arrive; an exception in one ends the merge."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put((i, None, exc))
            return
        await queue.put((i, end, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is end:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _complete(state: ServerState, runs, prepared, headers: dict):
    if prepared.endpoint == "completions":
        shaper = CompletionShaper(prepared, runs, state.converter.tokenizer)
        async for i, upd in _merged([run.updates() for run, _ in runs]):
            shaper.choices[i].feed(upd)
        return JSONResponse(shaper.final(), headers=headers)
    async for i, chunks in _merged([run.chunks() for run, _ in runs]):
        for c in chunks:
            runs[i][0].response.accumulate(c)
    if len(runs) == 1:
        return Response(runs[0][0].response.to_json(), media_type="application/json", headers=headers)
    outs = [json.loads(run.response.to_json()) for run, _ in runs]
    merged = outs[0]
    merged["choices"] = [{**o["choices"][0], "index": i} for i, o in enumerate(outs)]
    merged["usage"] = _sum_usage([o.get("usage") for o in outs])
    return JSONResponse(merged, headers=headers)


def _sum_usage(usages: list) -> dict | None:
    """n choices of one prompt: the prompt once, the completions summed (reasoning tokens too)."""
    usages = [u for u in usages if u]
    if not usages:
        return None
    out = json.loads(json.dumps(usages[0]))
    done = sum(u.get("completion_tokens", 0) for u in usages)
    out["completion_tokens"] = done
    out["total_tokens"] = out.get("prompt_tokens", 0) + done
    details = out.get("completion_tokens_details")
    if isinstance(details, dict) and "reasoning_tokens" in details:
        details["reasoning_tokens"] = sum((u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
                                          for u in usages)
    return out


async def _sse(state: ServerState, runs, prepared):
    """Server-sent events; the last data event carries usage. A client that disconnects cancels this generator:
    `finally` aborts the requests in the engine."""
    try:
        if prepared.endpoint == "completions":
            shaper = CompletionShaper(prepared, runs, state.converter.tokenizer)
            async for i, upd in _merged([run.updates() for run, _ in runs]):
                out = shaper.chunk(i, upd)
                if out is not None:
                    yield f"data: {json.dumps(out)}\n\n"
            if prepared.include_usage:
                yield f"data: {json.dumps(shaper.usage_chunk())}\n\n"
            yield "data: [DONE]\n\n"
            return
        cls = prepared.response_cls
        if prepared.endpoint != "chat":
            async for _, chunks in _merged([runs[0][0].chunks()]):
                for c in chunks:
                    name = cls.sse_event_name(c)
                    yield (f"event: {name}\n" if name else "") + f"data: {c.to_json()}\n\n"
        else:  # each sample's chunks carry its choice index; usage only as OpenAI's include_usage defines it
            usages, last = [], None
            async for i, chunks in _merged([run.chunks() for run, _ in runs]):
                for c in chunks:
                    data = json.loads(c.to_json())
                    for choice in data.get("choices") or []:
                        choice["index"] = i
                    if data.get("usage"):
                        usages.append(data["usage"])
                    if prepared.include_usage:
                        data["usage"] = None
                    else:
                        data.pop("usage", None)
                    last = data
                    yield f"data: {json.dumps(data)}\n\n"
            if prepared.include_usage and usages and last is not None:
                yield f"data: {json.dumps({**last, 'choices': [], 'usage': _sum_usage(usages)})}\n\n"
        done = cls.sse_done_data()
        if done is not None:
            yield f"data: {done}\n\n"
    except HTTPError as exc:  # the engine failed the request after the stream began: say so in the stream
        name = "error" if prepared.endpoint in ("messages", "responses") else None
        yield (f"event: {name}\n" if name else "") + f"data: {json.dumps(exc.body(prepared.endpoint))}\n\n"
        if prepared.endpoint in ("chat", "completions"):  # the stream's end marker all the same
            yield "data: [DONE]\n\n"
    finally:
        _close(runs)
