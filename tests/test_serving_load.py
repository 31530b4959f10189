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
def test_small_load_with_a_tight_admission_queue_answers_429_and_loses_nothing():
    server = ThreadServer(["engine.max_num_seqs=4", "serve.max_queued_requests=8"])
    try:
        reqs = serve_load.make_requests(40, invalid=0.0, disconnect=0.0, max_tokens=64, seed=1)
        results = asyncio.run(_run(server.url, reqs))
        statuses = sorted({r["status"] for r in results})
        assert statuses == [200, 429], statuses  # 12 in flight at most (4 running + 8 queued): the rest are refused at once
        assert all(r["finished"] and r["done"] for r in results if r["status"] == 200)
        assert server.idle(timeout=30)
    finally:
        server.close()


async def _run(url, reqs):
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(serve_load.one(client, url, r) for r in reqs))
