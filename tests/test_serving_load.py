"""Bounded load on the server (benchmarks/serve_load.py's generator): 500 concurrent streaming requests with short
max_tokens, 10% invalid, 10% of clients leaving mid-stream. Every valid request must end complete, every invalid
one get a 4xx, and afterwards no request may be in flight and the engine's cache manager must hold no block or slot
(the disconnected requests were aborted and freed)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
from serving_helpers import ThreadServer

spec = importlib.util.spec_from_file_location(
    "serve_load", Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py")
serve_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_load)


@pytest.mark.timeout(600)
def test_500_concurrent_streams_none_lost_cache_freed():
    server = ThreadServer(["engine.max_num_seqs=64", "serve.max_queued_requests=512"])
    try:
        reqs = serve_load.make_requests(500, invalid=0.1, disconnect=0.1, max_tokens=6, seed=0)
        summary = asyncio.run(serve_load.run_load(server.url, reqs))
        assert summary["valid"] == 400 and summary["invalid"] == 50 and summary["disconnected"] == 50
        assert summary["valid_lost"] == 0, summary
        assert summary["invalid_not_4xx"] == 0, summary
        assert summary["disconnect_failed"] == 0, summary
        assert server.idle(timeout=60), "requests or cache left behind after the load"
    finally:
        server.close()
    assert not server.thread.is_alive()


@pytest.mark.timeout(300)
def test_a_full_admission_queue_answers_429_and_the_admitted_requests_complete():
    server = ThreadServer(["engine.max_num_seqs=1", "serve.max_queued_requests=1"])
    try:
        first, second, refused, again = asyncio.run(_fill_then_overflow(server))
        for r in (first, second):  # 1 running + 1 queued: both admitted, both complete
            assert r["status"] == 200 and r["finished"] and r["done"], r
        assert [r.status_code for r in refused] == [429] * 3
        assert "serve.max_queued_requests" in refused[0].json()["error"]["message"]
        assert again.status_code == 200  # room again once they are done
        assert server.idle(timeout=30)
    finally:
        server.close()


async def _fill_then_overflow(server):
    import httpx

    body = {"model": serve_load.MODEL, "prompt": "def f(", "max_tokens": 200, "stream": True}
    req = {"kind": "valid", "path": "/v1/completions", "body": body}
    async with httpx.AsyncClient(timeout=120) as client:
        admitted = [asyncio.ensure_future(serve_load.one(client, server.url, req)) for _ in range(2)]
        while server.engine.num_in_flight < 2:  # both accepted (a queued stream sends headers with its first token)
            await asyncio.sleep(0.01)
        refused = [await client.post(f"{server.url}/v1/completions", json={**body, "stream": False})
                   for _ in range(3)]
        first, second = await asyncio.gather(*admitted)
        again = await client.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2, "stream": False})
    return first, second, refused, again
