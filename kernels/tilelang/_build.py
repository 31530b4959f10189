"""Compile-once plumbing shared by the TileLang kernels: the persistent kernel cache, compile statistics, the GPU's
SM count, inputs laid out as the kernels' vector loads want them (`dense`), and the kernel manifest.

Every kernel module exposes pure `build_*(...) -> prim_func` builders (no GPU needed) and calls `jit(builder,
*static_args)` at run time. Builders take only hashable static arguments (shapes that fix the tiling, dtypes);
dimensions that change per call (tokens, slots) are symbolic inside the prim_func, so one compiled kernel
serves every batch size.

Compiled kernels persist across runs in TileLang's disk cache, which `jit` points at `cache_dir()`:
`DEEPINFER_JIT_CACHE_DIR`, else an explicit `TILELANG_CACHE_DIR`, else ~/.cache/deepinfer/jit. TileLang keys an
entry by the kernel's source, target and pass configs, so a changed kernel is rebuilt, never served stale. A
fresh machine spends most of its start-up here (39 of 43 s in one first run), hence `jit_stats()` for the run
summary and `precompile()` to build many kernels on a thread pool ahead of the first step.

The kernel manifest (`DEEPINFER_JIT_MANIFEST`, a JSON-lines file) makes that start-up parallel on a machine whose
cache is empty: every kernel a process compiles is appended to it as a line (its builder and static arguments),
and the first `jit` of a later process compiles every kernel the file lists on a thread pool before it returns.
Kernels compiled one at a time, as a run first meets them, took 161 s of a 194 s decode benchmark on a fresh
H200 machine (57 kernels). A line whose builder is gone or whose arguments the current code rejects is skipped
and counted (`jit_stats()["manifest"]`), never fatal: the kernel the run needs is then built on first use.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

log = logging.getLogger(__name__)

# Pass configs every kernel here shares: the dequant / gather loops do their own vectorisation, and the
# auto warp-specialised producer/consumer split fights the hand-placed dequant inside pipelined loops.
PASS_CONFIGS = {"tl.disable_warp_specialized": True}

_STATS_LOCK = threading.Lock()
_STATS = {"compiled": 0, "cache_hits": 0, "seconds": 0.0}


def cache_dir() -> str:
    """Where compiled kernels persist: DEEPINFER_JIT_CACHE_DIR, else TILELANG_CACHE_DIR if the user set it (the
    devpack does), else ~/.cache/deepinfer/jit."""
    return (os.environ.get("DEEPINFER_JIT_CACHE_DIR") or os.environ.get("TILELANG_CACHE_DIR")
            or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer", "jit"))


def use_cache_dir() -> str:
    """Point TileLang's disk cache at cache_dir(). TileLang reads TILELANG_CACHE_DIR on every lookup and creates
    its directories before each save, so this works whether or not tilelang is already imported."""
    path = cache_dir()
    os.environ["TILELANG_CACHE_DIR"] = path
    return path


def jit_stats() -> dict:
    """Kernels this process compiled (`compiled`), loaded from the disk cache (`cache_hits`), the seconds spent
    in both (`seconds`, summed over threads: precompile overlaps them), the cache directory, and whether the kernels
    launch as programmatic dependents (`pdl`: a benchmark's numbers name the launch mode they were measured in), and
    the kernel manifest's counts (`manifest`: None without DEEPINFER_JIT_MANIFEST; else its path, the kernels it
    listed at start-up, how many of those lines were stale or failed to build, the seconds the parallel build
    took, and the lines it holds now)."""
    try:
        pdl = pdl_enabled()
    except ValueError:  # a bad DEEPINFER_PDL is the config's one-line error (resolve); not every step's metrics'
        pdl = None
    manifest = _manifest_stats()
    with _STATS_LOCK:
        return dict(_STATS, cache_dir=cache_dir(), pdl=pdl, manifest=manifest)


def _record(kernel, seconds: float) -> None:
    # TileLang 0.1.15 tags the kernels it builds with their cache key (KernelCache._tag_kernel_cache_entry) and
    # returns disk-cache loads untagged; there is no public hit/miss signal.
    built = hasattr(kernel, "_tilelang_cache_key")
    with _STATS_LOCK:
        _STATS["compiled" if built else "cache_hits"] += 1
        _STATS["seconds"] += seconds


def cuda_arch(device=None) -> str:
    """'sm_90a' on Hopper (wgmma/TMA need the arch-specific target), 'sm_100a' on B200, else sm_XY."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    return arch + "a" if major in (9, 10) else arch


def dense(t):
    """`t` contiguous with a 16-byte aligned start (the kernels use 8 / 16-byte vector accesses; a view with an odd
    storage offset is copied, which changes nothing: the torch ops work on fresh copies too)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


@functools.lru_cache(maxsize=None)
def sm_count(device: str | None = None) -> int:
    """Streaming multiprocessors of the GPU (132 on an H200); steers split counts and grid sizes only."""
    import torch

    return torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()) \
        .multi_processor_count


def target(arch: str):
    from tvm.target import Target

    return Target({"kind": "cuda", "arch": arch})


@functools.lru_cache(maxsize=None)
def pdl_enabled() -> bool:
    """Programmatic dependent launch for every kernel built here: on unless `DEEPINFER_PDL=0` (read once per
    process; the GPU test suite passes with it on, and it takes 7-8% off the 40-layer decode step at B = 1 / 8)."""
    value = os.environ.get("DEEPINFER_PDL", "").strip().lower() or "1"
    if value not in ("0", "1", "true", "false", "on", "off"):
        raise ValueError(f"DEEPINFER_PDL={value!r}; allowed: 1/true/on or 0/false/off")
    return value in ("1", "true", "on")


def with_pdl(prim_func):
    """`prim_func` launched as a programmatic dependent of the kernel before it on the stream: each block first
    waits for that kernel's grid to finish and its writes to be visible (griddepcontrol.wait), then lets the next
    kernel's blocks be scheduled (launch_dependents). The wait comes before any memory access, so the kernel's
    reads and writes stay ordered as without PDL; what overlaps is the next grid's launch and block scheduling
    with this grid's run, which a decode step of ~2,000 short kernels pays once per kernel. The trigger follows
    the wait, so a kernel two launches on never starts before this one's predecessor has finished. A kernel that
    calls T.pdl_sync itself is left as it is."""
    from tilelang.cuda.language.pdl import pdl_sync, pdl_trigger
    from tvm import tirx
    from tvm.tirx import stmt_functor

    sync_op = pdl_sync().op
    own = []
    stmt_functor.post_order_visit(prim_func.body, lambda n: own.append(1) if isinstance(n, tirx.Call)
                                  and n.op.same_as(sync_op) else None)
    if own:  # the kernel places its own wait (gemv_kernel's weights_before_wait)
        return prim_func
    found = []

    def visit(s):
        if s.name_hint != "tilelang_root":
            return None
        found.append(s)
        body = tirx.SeqStmt([tirx.Evaluate(pdl_sync()), tirx.Evaluate(pdl_trigger()), s.body])
        return tirx.SBlock(s.iter_vars, s.reads, s.writes, s.name_hint, body, s.init, s.alloc_buffers,
                           s.match_buffers, s.annotations)

    body = stmt_functor.ir_transform(prim_func.body, None, visit, ["tirx.SBlock"])
    assert found, "with_pdl: no T.Kernel body in the prim_func"
    return prim_func.with_body(body)


def jit(builder: Callable, *args):
    """Compile `builder(*args)` for the current GPU once per process (from the disk cache when an earlier run
    compiled it). With DEEPINFER_JIT_MANIFEST set, the process's first call first builds every kernel the manifest
    lists, in parallel."""
    if not _MANIFEST_STARTED:
        _manifest_start()
    return _compiled(builder, *args)


@functools.lru_cache(maxsize=None)
def _compiled(builder: Callable, *args):
    use_cache_dir()
    t0 = time.perf_counter()
    prim_func = builder(*args)
    if pdl_enabled():
        prim_func = with_pdl(prim_func)
    kernel = _compile(prim_func)
    _record(kernel, time.perf_counter() - t0)
    _manifest_note(builder, args)
    return kernel


def _compile(prim_func):
    import tilelang

    tgt = target(cuda_arch())
    with tgt:
        return tilelang.compile(prim_func, target=tgt, pass_configs=PASS_CONFIGS)


def precompile(specs: Iterable[tuple], workers: int = 16) -> None:
    """jit(*spec) for many specs on a thread pool (TileLang lowering releases the GIL, nvcc is a subprocess);
    each lands in jit's cache, so the first call that needs it does not pay for it. For warm-up."""
    from concurrent.futures import ThreadPoolExecutor

    specs = list(dict.fromkeys(specs))
    if not specs:
        return
    with ThreadPoolExecutor(max(1, min(workers, len(specs)))) as pool:
        list(pool.map(lambda s: jit(*s), specs))


# ---------------------------------------------------------------------------------------------- kernel manifest
_MANIFEST_STARTED = False
_MANIFEST_LOCK = threading.Lock()  # held while the manifest's kernels build (its threads never take it)
_NOTE_LOCK = threading.Lock()      # appends to the file
_MANIFEST = {"path": None, "listed": 0, "stale": 0, "failed": 0, "seconds": 0.0, "known": set()}


def manifest_line(builder: Callable, args: tuple) -> str | None:
    """The manifest's line for jit(builder, *args): the builder as module:name and the arguments as a Python
    literal; None when the arguments are not plain literals (they could not be read back as they were)."""
    text = repr(tuple(args))
    try:
        if ast.literal_eval(text) != tuple(args):
            return None
    except (ValueError, SyntaxError):
        return None
    return json.dumps({"builder": f"{builder.__module__}:{builder.__qualname__}", "args": text})


def read_manifest(path: str) -> tuple[list[tuple], list[str], int]:
    """(jit specs, their lines, stale lines) of a manifest file: a line is stale when it is not a spec or its
    builder no longer exists."""
    specs, lines, stale = [], [], 0
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                entry = json.loads(line)
                module, name = entry["builder"].split(":")
                builder = getattr(importlib.import_module(module), name)
                args = ast.literal_eval(entry["args"])
                specs.append((builder, *args))
                lines.append(line)
            except (ValueError, KeyError, TypeError, SyntaxError, ImportError, AttributeError):
                stale += 1
    return specs, lines, stale


def _manifest_start() -> None:
    global _MANIFEST_STARTED
    with _MANIFEST_LOCK:
        if _MANIFEST_STARTED:
            return
        _MANIFEST_STARTED = True  # first: the build below calls jit from its threads
        path = os.environ.get("DEEPINFER_JIT_MANIFEST", "").strip()
        if not path:
            return
        _MANIFEST["path"] = path
        if not os.path.exists(path):
            return
        try:
            specs, lines, stale = read_manifest(path)
        except (OSError, UnicodeDecodeError) as e:  # not a text file we may read: the run goes on without it
            log.warning("kernel manifest %s not read (%s); kernels are built on first use and not recorded", path, e)
            _MANIFEST["path"] = None
            return
        _MANIFEST["known"].update(lines)  # already listed: not appended again
        t0 = time.perf_counter()

        def build(spec) -> int:
            try:
                jit(*spec)
                return 0
            except Exception:  # noqa: BLE001 (a listed spec the current code rejects: built on first use, or never)
                return 1

        specs = list(dict.fromkeys(specs))
        with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 16, len(specs) or 1))) as pool:
            failed = sum(pool.map(build, specs))
        _MANIFEST.update(listed=len(specs), stale=stale, failed=failed, seconds=time.perf_counter() - t0)
        if stale or failed:
            log.warning("kernel manifest %s: %d stale lines, %d of %d kernels failed to build (each is built on "
                        "first use instead)", path, stale, failed, len(specs))


def build_manifest() -> dict | None:
    """Build every kernel DEEPINFER_JIT_MANIFEST lists now, as a process's first jit would (benchmarks/jit_warm.py:
    a fresh machine's disk cache filled in parallel once); the manifest's counts (jit_stats()["manifest"])."""
    _manifest_start()
    return _manifest_stats()


def _manifest_stats() -> dict | None:
    if not _MANIFEST["path"]:
        return None
    with _NOTE_LOCK:
        return {k: v for k, v in _MANIFEST.items() if k != "known"} | {"lines": len(_MANIFEST["known"])}


def _manifest_note(builder: Callable, args: tuple) -> None:
    """Append a kernel this process compiled (or loaded from the disk cache) to the manifest, once."""
    path = _MANIFEST["path"]
    if not path:
        return
    line = manifest_line(builder, args)
    with _NOTE_LOCK:
        if line is None or line in _MANIFEST["known"]:
            return
        _MANIFEST["known"].add(line)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a") as f:  # one short write per line: appends from several processes stay whole
                f.write(line + "\n")
        except OSError as e:
            log.warning("kernel manifest %s not written (%s); kernels are no longer recorded", path, e)
            _MANIFEST["path"] = None

