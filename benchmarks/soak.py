"""Soak test of the HTTP server: steady mixed traffic for a while, with faults injected on a schedule, and a supervisor
that restarts the server when it exits (serve.exit_on_engine_death).

    python benchmarks/soak.py                                      # 10,000 requests over 20 minutes (the issue's run)
    python benchmarks/soak.py --duration 240 --rate 5 --out benchmarks/results/soak_cpu_short.json

Traffic (per request, drawn from a seeded generator): chat, streaming chat, completions, streaming completions,
Anthropic messages (half streaming), responses, and structured chat (a small json_schema); 10% invalid (a value out
of range, an unknown model, a body that is not an object), 10% streaming requests whose client disconnects after the
first event. Faults, at fractions of the run: 2,000 idle connections (the server runs under `ulimit -n 1024`),
oversized bodies (5 MB), two grammar floods, each from a client address of its own (127.0.0.2, 127.0.0.3: eight
distinct 10,000-value enums, their values `--flood-values` prefixed or unshared, and one 100,000-value enum of short
strings at once; the per-client bound answers some 429, the values cap the big one 400), the engine core SIGSTOPped
(the time until /health says 503 is measured; the server then exits once engine.heartbeat_timeout declares the core
dead, and is restarted), the engine core SIGKILLed (the server exits 1 and is restarted). A server exit counts as a
crash unless it is exit 1 with the "engine stopped" line within a minute after a core fault.

Each request ends as exactly one outcome: `completed` (200 and the protocol's end: [DONE], message_stop,
response.completed, or a whole JSON answer), `refused` (a clean 4xx/5xx with an error body, an error event in the
stream, or a connection refused while the server restarts: the client knows it was not served), `disconnected` (the
client left on purpose), `lost` (the connection broke with no answer and no error), `hung` (no end within
--request-timeout). RSS of the server and its engine core is sampled every second. Written: a JSON with the counts,
p50/p99 latency of completed requests, the RSS series, the fault log and a `targets` list; and a PNG of latency and
RSS over time next to it (skipped, with a line saying so, when matplotlib is not installed: it is not a project
dependency). The JSON keeps the latency series in 10-second windows (counts per outcome, p50/p99/max) and RSS every
5 s; the plot is drawn from every request.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import read_json  # noqa: E402

MODEL = "deepinfer-embedded-tiny"
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n", "class Config:", "The quick brown fox", "Hello there")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}


# ---- the server and its supervisor ------------------------------------------------------------------------------
class Supervisor:
    """Runs `python -m deepinfer serve=openai` on a fixed port under `ulimit -n 1024`, restarting it when it exits."""

    def __init__(self, port: int, run_dir: Path, overrides: list[str]):
        self.port, self.run_dir, self.overrides = port, run_dir, overrides
        self.proc: subprocess.Popen | None = None
        self.exits: list[dict] = []
        self.starts = 0
        self.stopping = False
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _spawn(self) -> None:
        args = [sys.executable, "-m", "deepinfer", "serve=openai", f"serve.port={self.port}",
                f"hydra.run.dir={self.run_dir}/run{self.starts}", *self.overrides]
        self.proc = subprocess.Popen(["bash", "-c", "ulimit -n 1024; exec " + " ".join(args)],
                                     stderr=subprocess.PIPE, text=True, cwd=self.run_dir)
        self.starts += 1
        self.stderr_tail: list[str] = []
        for line in self.proc.stderr:
            self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-20:]
            if "deepinfer: serving" in line:
                self.ready.set()
                break
        threading.Thread(target=self._drain_stderr, args=(self.proc,), daemon=True).start()

    def _drain_stderr(self, proc) -> None:
        for line in proc.stderr:
            self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-20:]

    def _loop(self) -> None:
        while not self.stopping:
            self._spawn()
            code = self.proc.wait()
            self.ready.clear()
            if self.stopping:
                break
            self.exits.append({"t": time.monotonic(), "code": code, "last_line": (self.stderr_tail or [""])[-1]})

    def engine_pid(self) -> int | None:
        try:
            kids = psutil.Process(self.proc.pid).children()
            return kids[0].pid if kids else None
        except psutil.Error:
            return None

    def rss_mb(self) -> tuple[float, float] | None:
        try:
            server = psutil.Process(self.proc.pid)
            core = server.children()
            return server.memory_info().rss / 2**20, sum(c.memory_info().rss for c in core) / 2**20
        except psutil.Error:
            return None

    def stop(self) -> int | None:
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return None


# ---- traffic ----------------------------------------------------------------------------------------------------
def make_request(rng: random.Random, i: int) -> dict:
    roll = rng.random()
    kind = "invalid" if roll < 0.1 else "disconnect" if roll < 0.2 else "valid"
    prompt = rng.choice(PROMPTS)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "thinking": {"type": "disabled"},
            "max_tokens": rng.randint(2, 12), "seed": i}
    shape = rng.choice(["chat", "chat_stream", "completions", "completions_stream", "messages", "responses",
                        "structured"])
    if kind == "disconnect":
        shape = rng.choice(["chat_stream", "completions_stream"])
    if shape.startswith("chat"):
        path, body = "/v1/chat/completions", dict(chat, stream=shape.endswith("stream"))
    elif shape.startswith("completions"):
        path, body = "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": chat["max_tokens"],
                                         "seed": i, "stream": shape.endswith("stream")}
    elif shape == "messages":
        path, body = "/v1/messages", {"model": MODEL, "messages": chat["messages"], "max_tokens": chat["max_tokens"],
                                      "thinking": {"type": "disabled"}, "stream": bool(i % 2)}
    elif shape == "responses":
        path, body = "/v1/responses", {"model": MODEL, "input": prompt, "max_output_tokens": chat["max_tokens"],
                                       "reasoning": {"effort": "none"}}
    else:
        path, body = "/v1/chat/completions", dict(chat, max_tokens=24, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    if kind == "disconnect":
        body.update(max_tokens=200, ignore_eos=True)
    if kind == "invalid":
        body = rng.choice([dict(body, temperature=7.5), dict(body, model="no-such-model"), dict(body, seed=2**70),
                           [1, 2, 3]])
    return {"i": i, "kind": kind, "shape": shape, "path": path, "body": body}


END_MARKERS = ("[DONE]", '"type": "message_stop"', '"type":"message_stop"', "response.completed")


async def run_one(client: httpx.AsyncClient, url: str, req: dict, timeout: float) -> dict:
    res = {"i": req["i"], "kind": req["kind"], "shape": req["shape"], "t": time.monotonic(), "status": None}
    t0 = time.perf_counter()
    try:
        res["outcome"] = await asyncio.wait_for(_exchange(client, url, req, res), timeout)
    except asyncio.TimeoutError:
        res["outcome"] = "hung"
    except httpx.ConnectError:
        res["outcome"] = "refused"  # the server is restarting: nothing was accepted
        res["why"] = "connection refused"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        res["outcome"], res["why"] = "lost", f"{type(exc).__name__}: {exc}"[:200]
    res["latency"] = time.perf_counter() - t0
    return res


def error_message(data) -> str | None:
    """The one-line reason of an error body in either protocol's shape ({"error": {"message"}}, Anthropic's
    {"type": "error", "error": {"message"}}), or None."""
    err = data.get("error") if isinstance(data, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    return msg if isinstance(msg, str) and msg.strip() else None


async def _exchange(client, url, req, res) -> str:
    """The request's outcome; a refusal is clean only with a reason in the protocol's error shape (kept in
    res["why"]), anything else that ends without the protocol's end is lost."""
    async with client.stream("POST", url + req["path"], json=req["body"]) as r:
        res["status"] = r.status_code
        if r.status_code != 200:
            body = await r.aread()
            try:
                reason = error_message(json.loads(body))
            except ValueError:
                reason = None
            res["why"] = reason or f"no reason: {body[:200].decode('latin-1')!r}"
            return "refused" if reason else "lost"
        if req["kind"] == "disconnect":
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return "disconnected"
            return "completed"
        if not req["body"].get("stream"):
            data = json.loads(await r.aread())
            if isinstance(data, dict) and data.get("error"):  # a Responses object always has "error": null
                res["why"] = error_message(data) or "no reason"
                return "refused" if error_message(data) else "lost"
            return "completed"
        text = ""
        async for line in r.aiter_lines():
            text += line + "\n"
        for line in text.splitlines():  # ended by the server with an error event (engine died, drain)
            if line.startswith("data: {") and '"error"' in line:
                data = json.loads(line[6:])
                if isinstance(data, dict) and data.get("error"):
                    reason = error_message(data)
                    res["why"] = reason or f"no reason: {line[:200]!r}"
                    return "refused" if reason else "lost"
        if any(m in text for m in END_MARKERS):
            return "completed"
        res["why"] = f"stream ended without its end marker: {text[-200:]!r}"
        return "lost"


# ---- faults -----------------------------------------------------------------------------------------------------
def idle_connections(port: int, n: int, hold_s: float, log: list) -> None:
    socks, refused = [], 0
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            refused += 1
    log.append({"fault": "idle_connections", "t": time.monotonic(), "opened": len(socks), "connect_failed": refused})
    time.sleep(hold_s)
    for s in socks:
        s.close()


def oversized_bodies(url: str, n: int, log: list) -> None:
    statuses = []
    for _ in range(n):
        try:
            r = httpx.post(url + "/v1/chat/completions", content=b'{"messages": "' + b"x" * (5 << 20) + b'"}',
                           headers={"content-type": "application/json"}, timeout=60)
            statuses.append(r.status_code)
        except httpx.HTTPError as exc:
            statuses.append(type(exc).__name__)
    log.append({"fault": "oversized_bodies", "t": time.monotonic(), "statuses": statuses})


def flood_value(kind: str, source: str, k: int, i: int) -> str:
    """Value i of schema k of a grammar flood: "prefixed" values share all but their last digits (IDs, codes: the
    server's enum trie stores the prefix once), "unshared" ones are 20 hex digits of a hash (nothing to share: the
    grammar compiles as large as xgrammar makes it)."""
    if kind == "unshared":
        return hashlib.sha1(f"{source}k{k}v{i}".encode()).hexdigest()[:20]
    return f"s{source}k{k}v{i}"


async def grammar_flood(url: str, n: int, values: int, source: str, log: list, kind: str = "prefixed") -> None:
    """n distinct heavy schemas at once (distinct: xgrammar caches a compiled schema by its text), as vLLM's
    `structured_outputs` (a response_format schema is also rendered into the prompt, past this model's context),
    plus one 100,000-value enum of short strings (under 1 MiB, over the values cap), from the address `source`:
    the server bounds compilations per client address, so the flood's 429s are its own. kind: flood_value's."""
    short = {"type": "object", "properties": {"x": {"enum": [f"v{i:05d}" for i in range(100_000)]}}}
    schemas = [{"type": "object", "properties": {"x": {"enum": [flood_value(kind, source, k, i)
                                                                for i in range(values)]}},
                "required": ["x"]} for k in range(n)] + [short]

    async def one(client, schema):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 8,
                "thinking": {"type": "disabled"}, "structured_outputs": {"json": schema}}
        try:
            r = await client.post(url + "/v1/chat/completions", json=body, timeout=300)
            return r.status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    t0 = time.monotonic()
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(transport=transport, limits=httpx.Limits(max_connections=64)) as client:
        statuses = await asyncio.gather(*(one(client, sch) for sch in schemas))
    log.append({"fault": "grammar_flood", "t": t0, "source": source, "statuses": list(statuses),
                "last_answer_after_s": round(time.monotonic() - t0, 2)})


def stop_core(sup: Supervisor, url: str, log: list, give_up_s: float = 60.0) -> None:
    pid = sup.engine_pid()
    if pid is None:
        log.append({"fault": "sigstop", "t": time.monotonic(), "error": "no engine core"})
        return
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    noticed = None
    while time.monotonic() - t0 < give_up_s:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 503:
                noticed = time.monotonic() - t0
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    log.append({"fault": "sigstop", "t": t0, "pid": pid, "health_503_after_s": noticed})
    # the server exits once engine.heartbeat_timeout declares the core dead; the supervisor restarts it; the stopped
    # core is killed by the server's close (SIGKILL), so nothing is left behind


def kill_core(sup: Supervisor, log: list) -> None:
    pid = sup.engine_pid()
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    log.append({"fault": "sigkill", "t": time.monotonic(), "pid": pid})


# ---- the run ----------------------------------------------------------------------------------------------------
async def soak(args, sup: Supervisor, url: str) -> dict:
    rng = random.Random(args.seed)
    n = int(args.duration * args.rate)
    results, faults, rss = [], [], []
    t_start = time.monotonic()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    schedule = [(0.15, "idle"), (0.25, "oversized"), (0.35, "grammar:127.0.0.2"), (0.5, "sigstop"),
                (0.6, "grammar:127.0.0.3"), (0.75, "sigkill")]
    done_faults: set = set()
    loop = asyncio.get_running_loop()

    async def sample_rss():
        while True:
            value = sup.rss_mb()
            if value is not None:
                rss.append({"t": time.monotonic() - t_start, "server_mb": value[0], "core_mb": value[1],
                            "instance": sup.starts})
            await asyncio.sleep(1.0)

    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        sampler = asyncio.ensure_future(sample_rss())
        tasks = []
        for i in range(n):
            target = t_start + i / args.rate
            await asyncio.sleep(max(0.0, target - time.monotonic()))
            frac = (time.monotonic() - t_start) / args.duration
            for at, name in schedule:
                if frac >= at and name not in done_faults:
                    done_faults.add(name)
                    if name == "idle":
                        loop.run_in_executor(None, idle_connections, args.port, args.idle_connections, 20.0, faults)
                    elif name == "oversized":
                        loop.run_in_executor(None, oversized_bodies, url, 6, faults)
                    elif name.startswith("grammar:"):
                        source = name.split(":", 1)[1]
                        tasks.append(asyncio.ensure_future(grammar_flood(url, 8, 10_000, source, faults,
                                                                          args.flood_values)))
                    elif name == "sigstop":
                        loop.run_in_executor(None, stop_core, sup, url, faults)
                    elif name == "sigkill":
                        loop.run_in_executor(None, kill_core, sup, faults)
            tasks.append(asyncio.ensure_future(run_one(client, url, make_request(rng, i), args.request_timeout)))
        gathered = await asyncio.gather(*tasks)
        # the last request is sent at (n - 1) / rate: the run (and the RSS samples) last the whole duration
        await asyncio.sleep(max(0.0, t_start + args.duration - time.monotonic()))
        sampler.cancel()
    results = [r for r in gathered if isinstance(r, dict)]
    for r in results:
        r["t"] -= t_start
    for f in faults:
        f["t"] -= t_start
    return {"results": results, "faults": faults, "rss": rss, "wall_s": time.monotonic() - t_start,
            "t_start": t_start}


CORE_FAULTS = ("sigstop", "sigkill")


def rss_growth(rss: list[dict], duration: float, faults: list[dict], until=CORE_FAULTS) -> float | None:
    """Growth of the first server instance's RSS (server + engine core) from the end of warm-up (10% of the run) to
    its highest sample before the first fault named in `until` (the first engine-core fault), as a fraction of the
    first sample after warm-up."""
    end = min((f["t"] for f in faults if f["fault"] in until), default=float("inf"))
    warm = [s for s in rss if s["instance"] == 1 and 0.1 * duration <= s["t"] < end and s["core_mb"] > 0]
    if len(warm) < 2:
        return None
    start = warm[0]["server_mb"] + warm[0]["core_mb"]
    return (max(s["server_mb"] + s["core_mb"] for s in warm) - start) / start


def last_instance_growth(rss: list[dict]) -> float | None:
    """The same for the last server instance, from 30 s after its first sample to its end (informative: a leak
    would show in every instance)."""
    last = max((s["instance"] for s in rss), default=None)
    samples = [s for s in rss if s["instance"] == last and s["core_mb"] > 0]
    if not samples:
        return None
    warm = [s for s in samples if s["t"] >= samples[0]["t"] + 30]
    if len(warm) < 2:
        return None
    start = warm[0]["server_mb"] + warm[0]["core_mb"]
    return (max(s["server_mb"] + s["core_mb"] for s in warm) - start) / start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def classify_exits(exits: list[dict], faults: list[dict]) -> list[dict]:
    """Each server exit with `expected`: exit 1 with serve.exit_on_engine_death's line within 60 s after an
    engine-core fault; anything else is a crash."""
    core = [f["t"] for f in faults if f["fault"] in CORE_FAULTS]
    out = []
    for e in exits:
        expected = (e["code"] == 1 and "the engine stopped" in e["last_line"]
                    and any(0 <= e["t"] - t <= 60 for t in core))
        out.append({**e, "expected": expected})
    return out


def windows(results: list[dict], width: float = 10.0) -> list[dict]:
    """Per `width` seconds of send time: requests per outcome and latency p50/p99/max of the completed ones."""
    out = []
    last = max((r["t"] for r in results), default=0.0)
    for k in range(int(last // width) + 1):
        rs = [r for r in results if k * width <= r["t"] < (k + 1) * width]
        lat = [r["latency"] for r in rs if r["outcome"] == "completed"]
        counts = {o: sum(1 for r in rs if r["outcome"] == o) for o in sorted({r["outcome"] for r in rs})}
        out.append({"t": k * width, **counts, "p50_s": _round(percentile(lat, 0.5)),
                    "p99_s": _round(percentile(lat, 0.99)), "max_s": _round(max(lat, default=None))})
    return out


def _round(x, nd: int = 3):
    return None if x is None else round(x, nd)


def summarize(args, run: dict, sup: Supervisor, final_code) -> dict:
    results = run["results"]
    counts: dict = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    refused_by, reasons = {}, {}
    for r in results:
        if r["outcome"] == "refused":
            key = str(r["status"]) if r["status"] is not None else "connection refused (server restarting)"
            refused_by[key] = refused_by.get(key, 0) + 1
            why = re.sub(r"\d+", "N", r.get("why", ""))[:90]  # pids, values, sizes: one line per kind of reason
            reasons[why] = reasons.get(why, 0) + 1
    # an invalid request must get a 4xx, unless the engine was down (503) or the server restarting (no connection)
    invalid_bad = [r for r in results if r["kind"] == "invalid" and r["status"] not in (None, 503)
                   and not 400 <= r["status"] < 500]
    lat = [r["latency"] for r in results if r["outcome"] == "completed"]
    growth = rss_growth(run["rss"], args.duration, run["faults"])
    growth_last = last_instance_growth(run["rss"])
    # a grammar flood's compiled grammars are a step (xgrammar's cache and the allocator keep them), not a leak
    growth_no_flood = rss_growth(run["rss"], args.duration, run["faults"], until=CORE_FAULTS + ("grammar_flood",))
    stop = next((f for f in run["faults"] if f["fault"] == "sigstop"), {})
    idle = next((f for f in run["faults"] if f["fault"] == "idle_connections"), {})
    oversized = [st for f in run["faults"] if f["fault"] == "oversized_bodies" for st in f["statuses"]]
    floods = [f for f in run["faults"] if f["fault"] == "grammar_flood"]
    # 503 / ConnectError: the flood met a dead engine or a server restarting (the client knows it was not served)
    flood_bad = [st for f in floods for st in f["statuses"] if st not in (200, 400, 429, 503, "ConnectError")]
    exits = classify_exits([{**e, "t": e["t"] - run["t_start"]} for e in sup.exits], run["faults"])
    crashes = [e for e in exits if not e["expected"]]
    # the connections are opened before idle["t"] and held 20 s after it; a core fault's planned exit does not count
    idle_exits = [e for e in crashes if idle and idle["t"] - 30 <= e["t"] <= idle["t"] + 30]
    targets = [
        {"name": "crashes (server exits other than exit_on_engine_death's exit 1 after a core fault)",
         "measured": len(crashes), "target": 0, "unit": "exits", "met": not crashes},
        {"name": "lost requests", "measured": counts.get("lost", 0), "target": 0, "unit": "requests",
         "met": counts.get("lost", 0) == 0},
        {"name": "hung requests", "measured": counts.get("hung", 0), "target": 0, "unit": "requests",
         "met": counts.get("hung", 0) == 0},
        {"name": "invalid requests not answered 4xx (503 while the engine was down aside)", "measured":
         len(invalid_bad), "target": 0, "unit": "requests", "met": not invalid_bad},
        {"name": "hostile fault traffic not answered in its protocol's shape (5 MB bodies: 413; grammar floods: "
                 "200, 400 or 429; 503 or no connection while the engine is down)",
         "measured": sum(1 for st in oversized if st != 413) + len(flood_bad), "target": 0, "unit": "requests",
         "met": bool(oversized) and bool(floods) and all(st == 413 for st in oversized) and not flood_bad},
        {"name": "server up through idle connections at a 1024 open-file limit", "measured": idle.get("opened"),
         "target": args.idle_connections, "unit": "connections opened",
         "met": bool(idle) and idle.get("opened") == args.idle_connections and not idle_exits},
        {"name": "RSS growth after warm-up (first server instance, before the first core fault)",
         "measured": None if growth is None else round(100 * growth, 1), "target": 10, "unit": "%",
         "met": growth is not None and growth <= 0.10},
        {"name": "stopped core reported by /health", "measured": _round(stop.get("health_503_after_s"), 2),
         "target": 5, "unit": "s",
         "met": stop.get("health_503_after_s") is not None and stop["health_503_after_s"] <= 5},
        {"name": "requests sent", "measured": len(results), "target": 10000, "unit": "requests",
         "met": len(results) >= 10000},
        {"name": "duration", "measured": round(run["wall_s"]), "target": 1200, "unit": "s",
         "met": run["wall_s"] >= 1200},
    ]
    return {
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "server_overrides": args.overrides,
        "flood_values": args.flood_values,
        "outcomes": counts,
        "refused_by_status": refused_by,
        "refused_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:25]),
        "by_kind": {k: {o: sum(1 for r in results if r["kind"] == k and r["outcome"] == o)
                        for o in sorted({r["outcome"] for r in results})} for k in ("valid", "invalid", "disconnect")},
        "latency_completed_s": {"p50": _round(percentile(lat, 0.5)), "p99": _round(percentile(lat, 0.99)),
                                "max": _round(max(lat, default=None))},
        "rss_growth_last_instance_pct": None if growth_last is None else round(100 * growth_last, 1),
        "rss_growth_before_first_flood_pct": None if growth_no_flood is None else round(100 * growth_no_flood, 1),
        "server_starts": sup.starts, "server_exits": exits, "final_sigterm_exit_code": final_code,
        "faults": run["faults"],
        "examples_not_completed": [r for r in results if r["outcome"] in ("lost", "hung")][:10],
        "targets": targets,
        "latency_windows": windows(results),
        "rss_series": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in smp.items()}
                       for smp in run["rss"][::5]],
    }


def plot(results: list[dict] | None, summary: dict, path: Path) -> bool:
    """The PNG of latency (every request, by outcome; results None: the JSON's 10-second windows, p50 / p99 / max of
    the completed ones) and RSS over time; False when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    if results is None:
        for key, color in (("p50_s", "tab:blue"), ("p99_s", "tab:orange"), ("max_s", "tab:red")):
            pts = [(w["t"], w[key]) for w in summary["latency_windows"] if w.get(key) is not None]
            if pts:
                a.plot(*zip(*pts), ".-", markersize=2, linewidth=0.8, color=color,
                       label=f"completed, {key[:-2]} of 10 s")
        top = max((w["max_s"] for w in summary["latency_windows"] if w.get("max_s") is not None), default=1.0)
    else:
        for outcome, color in (("completed", "tab:blue"), ("refused", "tab:orange"), ("lost", "tab:red"),
                               ("hung", "black")):
            pts = [(r["t"], r["latency"]) for r in results if r["outcome"] == outcome]
            if pts:
                a.scatter(*zip(*pts), s=3, color=color, label=outcome)
        top = max((r["latency"] for r in results), default=1.0)
    for f in summary["faults"]:
        for ax in (a, b):
            ax.axvline(f["t"], color="gray", linestyle=":", linewidth=1)
        a.annotate(f["fault"], (f["t"], top), fontsize=7, rotation=90, va="top")
    a.set_ylabel("latency (s)")
    a.set_yscale("log")
    a.legend(fontsize=8, loc="lower right")
    rss = summary["rss_series"]
    b.plot([s["t"] for s in rss], [s["server_mb"] for s in rss], ".", markersize=2, label="server RSS")
    b.plot([s["t"] for s in rss], [s["core_mb"] for s in rss], ".", markersize=2, label="engine core RSS")
    b.set_ylabel("RSS (MiB)")
    b.set_xlabel("time since start (s)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _dumps(summary: dict) -> str:
    """Indented JSON with each series entry on one line (10,000 requests' windows stay readable and small)."""
    head = {k: v for k, v in summary.items() if k not in ("latency_windows", "rss_series")}
    text = json.dumps(head, indent=1)[:-2]
    for key in ("latency_windows", "rss_series"):
        rows = ",\n  ".join(json.dumps(x, separators=(",", ":")) for x in summary[key])
        text += f',\n "{key}": [\n  {rows}\n ]'
    return text + "\n}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1200.0, help="seconds of traffic")
    ap.add_argument("--rate", type=float, default=10000 / 1200, help="requests per second")
    ap.add_argument("--idle-connections", type=int, default=2000)
    ap.add_argument("--request-timeout", type=float, default=180.0, help="seconds before a request counts as hung")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flood-values", choices=("prefixed", "unshared"), default="prefixed",
                    help="the grammar floods' enum values (flood_value)")
    ap.add_argument("--run-dir", default="outputs/soak")
    ap.add_argument("--out", default=None, help="JSON path (a PNG is written beside it)")
    ap.add_argument("--overrides", nargs="*", default=[
        "engine.max_num_seqs=32", "cache.memory_budget=134217728", "engine.heartbeat_timeout=10",
        "serve.header_timeout=5"], help="server config overrides")
    ap.add_argument("--plot-from", default=None,
                    help="only draw this recorded JSON's (or .json.xz's) PNG beside it (no run)")
    args = ap.parse_args(argv)
    if args.plot_from:
        path = Path(args.plot_from)
        png = (path.with_suffix("") if path.suffix == ".xz" else path).with_suffix(".png")  # x.json.xz: x.png
        if not plot(None, read_json(path), png):
            print("soak: matplotlib is not installed (not a project dependency): no plot", file=sys.stderr)
            return 1
        print(f"soak: wrote {png}")
        return 0
    args.port = free_port()
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(args.port, run_dir, args.overrides)
    sup.start()
    if not sup.ready.wait(300):
        print("soak: the server did not start", file=sys.stderr)
        return 1
    url = f"http://127.0.0.1:{args.port}"
    try:
        run = asyncio.run(soak(args, sup, url))
        sup.ready.wait(120)  # a restart in progress finishes before the final SIGTERM
    finally:
        final = sup.stop()
    summary = summarize(args, run, sup, final)
    if args.out:
        Path(args.out).write_text(_dumps(summary) + "\n")
        png = Path(args.out).with_suffix(".png")
        if not plot(run["results"], summary, png):
            print(f"soak: matplotlib is not installed (not a project dependency): no plot written to {png}; "
                  "`pip install matplotlib` to get it", file=sys.stderr)
    print(json.dumps({k: summary[k] for k in ("outcomes", "latency_completed_s", "server_starts", "targets")},
                     indent=1))
    return 0 if all(t["met"] for t in summary["targets"] if t["name"] not in ("requests sent", "duration")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
