"""Load test of the HTTP server: many concurrent streaming requests, some invalid, some clients leaving mid-stream.

    python benchmarks/serve_load.py                          # starts `python -m deepinfer serve=openai` itself
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --requests 500
    python benchmarks/serve_load.py --out benchmarks/results/serve_load_cpu.json

Every request streams (SSE) with a short max_tokens, half of them /v1/chat/completions (thinking off) and half
/v1/completions. `--invalid` of them are invalid (temperature out of range, unknown model, a prompt past the
context) and must get a 4xx; `--disconnect` of them close the connection after their first event and must be
aborted. Reported: requests/s over the whole run, TTFT (request sent -> first content event) p50/p99, and what was
lost: a valid request that did not end with its finish event and [DONE], an invalid one that did not get a 4xx.
After the run the server's /metrics must show no request waiting or running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "deepinfer-embedded-tiny"  # the embedded model's served name (serving.server.model_identity)
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Config:", "The quick brown fox", "Hello")


def make_requests(n: int, invalid: float, disconnect: float, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    kinds = ["invalid"] * round(n * invalid) + ["disconnect"] * round(n * disconnect)
    kinds += ["valid"] * (n - len(kinds))
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        prompt = rng.choice(PROMPTS)
        if i % 2:
            path, body = "/v1/completions", {"model": MODEL, "prompt": prompt}
        else:
            path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                                  "thinking": {"type": "disabled"}}
        body.update(max_tokens=rng.randint(max(1, max_tokens // 2), max_tokens), stream=True, seed=i)
        if kind == "invalid":
            body.update(rng.choice([{"temperature": 5.0}, {"model": "no-such-model"}, {"max_tokens": 10**6}]))
        if kind == "disconnect":  # long enough that it is still running when the client leaves
            body["max_tokens"] = max_tokens * 20
        out.append({"kind": kind, "path": path, "body": body})
    return out


async def one(client: httpx.AsyncClient, url: str, req: dict) -> dict:
    t0 = time.perf_counter()
    res = {"kind": req["kind"], "status": None, "ttft": None, "finished": False, "done": False, "events": 0}
    try:
        async with client.stream("POST", url + req["path"], json=req["body"]) as r:
            res["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res["done"] = True
                    continue
                res["events"] += 1
                chunk = json.loads(data)
                choice = (chunk.get("choices") or [{}])[0]
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and res["ttft"] is None:
                    res["ttft"] = time.perf_counter() - t0
                if choice.get("finish_reason"):
                    res["finished"] = True
                if req["kind"] == "disconnect" and res["events"] >= 2:
                    return res  # leaving the `async with` closes the connection mid-stream
    except httpx.HTTPError as exc:
        res["status"] = f"{type(exc).__name__}"
    finally:
        res["latency"] = time.perf_counter() - t0
    return res


async def run_load(url: str, requests: list[dict], concurrency: int | None = None) -> dict:
    limits = httpx.Limits(max_connections=concurrency or len(requests), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, r) for r in requests))
        wall = time.perf_counter() - t0
        metrics = (await client.get(url + "/metrics")).text
    return summarize(results, wall, metrics)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(results: list[dict], wall: float, metrics: str) -> dict:
    valid = [r for r in results if r["kind"] == "valid"]
    invalid = [r for r in results if r["kind"] == "invalid"]
    gone = [r for r in results if r["kind"] == "disconnect"]
    ttfts = [r["ttft"] for r in valid if r["ttft"] is not None]
    gauges = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines()
              if ln.startswith(("deepinfer_requests_waiting", "deepinfer_requests_running"))}
    return {
        "requests": len(results),
        "valid": len(valid),
        "invalid": len(invalid),
        "disconnected": len(gone),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 2),
        "ttft_p50_s": round(_pct(ttfts, 0.5), 3) if ttfts else None,
        "ttft_p99_s": round(_pct(ttfts, 0.99), 3) if ttfts else None,
        "valid_lost": sum(not (r["status"] == 200 and r["finished"] and r["done"]) for r in valid),
        "invalid_not_4xx": sum(not (isinstance(r["status"], int) and 400 <= r["status"] < 500) for r in invalid),
        "disconnect_failed": sum(r["status"] != 200 for r in gone),
        "after": gauges,
    }


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "deepinfer", "serve=openai", "serve.port=0", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "serving" in line:
            return proc, line.strip().rsplit(" ", 1)[1]
    raise RuntimeError(f"the server did not start (exit code {proc.wait()})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server; default: start one (embedded model, CPU)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--invalid", type=float, default=0.1)
    ap.add_argument("--disconnect", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", nargs="*", default=["engine.max_num_seqs=64", "cache.memory_budget=268435456"],
                    help="overrides for the server this script starts")
    ap.add_argument("--out", help="write the summary JSON here (e.g. benchmarks/results/serve_load_cpu.json)")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.server_args)
    try:
        reqs = make_requests(args.requests, args.invalid, args.disconnect, args.max_tokens, args.seed)
        summary = asyncio.run(run_load(url, reqs))
    finally:
        if proc is not None:
            proc.terminate()
            summary_rc = proc.wait(timeout=60)
    summary["command"] = "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])
    if proc is not None:
        summary["server"] = {"args": args.server_args, "exit_code_after_sigterm": summary_rc}
    summary["cpus"] = os.cpu_count()
    # nothing lost (the serving issues' target): every valid request finished, every invalid one a 4xx, every
    # disconnect aborted
    summary["targets"] = [dict(name=name, measured=summary[key], target=0, unit="requests", met=summary[key] == 0)
                          for name, key in (("valid requests lost", "valid_lost"),
                                            ("invalid requests without a 4xx", "invalid_not_4xx"),
                                            ("disconnects not aborted", "disconnect_failed"))]
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    lost = summary["valid_lost"] + summary["invalid_not_4xx"] + summary["disconnect_failed"]
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
