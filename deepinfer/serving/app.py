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

from deepinfer.serving.completions_shape import CompletionShaper
from deepinfer.serving.errors import HTTPError, bad_request
from deepinfer.serving.metrics import CONTENT_TYPE_LATEST
from deepinfer.serving.request_run import RequestRun

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


class ClientGone(Exception):
    pass


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine.start(asyncio.get_running_loop())  # the pump delivers to this loop
        yield

    app = FastAPI(title="DeepInfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    started = int(time.time())

    @app.get("/health")
    async def health():
        if state.engine.dead is not None:
            return JSONResponse({"status": "error", "error": state.engine.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.served_name, "object": "model", "created": started,
                                            "owned_by": "deepinfer", "max_model_len": state.max_model_len}]}

    for path, endpoint in ROUTES.items():
        app.add_api_route(path, _handler(state, endpoint), methods=["POST"])
    return app


def _handler(state: ServerState, endpoint: str):
    async def handle(request: Request):
        run = None
        try:
            body = await _json_body(request)
            _admit(state)
            if endpoint == "completions":
                prepared = state.converter.convert_completion(body)
            else:
                prepared = state.converter.convert(endpoint, body)
            run = RequestRun(state.engine, prepared, state.metrics)
            await _until_disconnect(request, run.start())
            if prepared.stream:
                return StreamingResponse(_sse(run, prepared), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await _until_disconnect(request, _complete(run, prepared))
        except HTTPError as exc:
            if run is None or run.stream is None or exc.status != 400:
                state.metrics.on_rejected(exc.status)
            if run is not None:
                run.close()
            return JSONResponse(exc.body(endpoint), status_code=exc.status)
        except ClientGone:
            run.close()
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except BaseException:
            if run is not None:
                run.close()
            raise

    return handle


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not JSON ({getattr(exc, 'msg', type(exc).__name__)})") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body is a JSON {type(body).__name__}; allowed: a JSON object")
    return body


def _admit(state: ServerState) -> None:
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


async def _complete(run: RequestRun, prepared):
    if prepared.endpoint == "completions":
        shaper = CompletionShaper(prepared, lambda: run.num_tokens)
        async for chunks in run.chunks():
            for c in chunks:
                shaper.feed(c)
        return JSONResponse(shaper.final())
    async for chunks in run.chunks():
        for c in chunks:
            prepared.response.accumulate(c)
    return Response(prepared.response.to_json(), media_type="application/json")


async def _sse(run: RequestRun, prepared):
    """Server-sent events; the last data event carries usage. A client that disconnects cancels this generator:
    `finally` aborts the request in the engine."""
    try:
        if prepared.endpoint == "completions":
            shaper = CompletionShaper(prepared, lambda: run.num_tokens)
            async for chunks in run.chunks():
                for c in chunks:
                    out = shaper.feed(c)
                    if out is not None:
                        yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"
            return
        cls = prepared.response_cls
        async for chunks in run.chunks():
            for c in chunks:
                name = cls.sse_event_name(c)
                yield (f"event: {name}\n" if name else "") + f"data: {c.to_json()}\n\n"
        done = cls.sse_done_data()
        if done is not None:
            yield f"data: {done}\n\n"
    except HTTPError as exc:  # the engine failed the request after the stream began: say so in the stream
        name = "error" if prepared.endpoint in ("messages", "responses") else None
        yield (f"event: {name}\n" if name else "") + f"data: {json.dumps(exc.body(prepared.endpoint))}\n\n"
    finally:
        run.close()
