"""Gives freed heap pages back to the OS after a heavy grammar is released, off the caller's thread.

Why: a 10,000-value enum's compiled grammar is ~30 MB of small C++ allocations; when its request ends they are
freed, but glibc keeps the pages in its arenas, so the engine core's RSS stays at its peak after a grammar flood
(measured: four such enums compiled without xgrammar's cache, +190 MB after they were freed; +48 MB after
malloc_trim(0)). Trimming is a heap walk (milliseconds to tens of them), so it runs on a daemon thread of its own,
woken by `request()`, never on the step loop that drops the grammar. Not glibc (no malloc_trim): a no-op.
`limit_arenas()` caps the engine core's malloc arenas, so what a compile thread freed is in an arena a trim
gives back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

_lock = threading.Lock()
_wake = threading.Event()
_thread: threading.Thread | None = None
requested = 0  # how many trims were asked for
trimmed_upto = 0  # the value of `requested` when the last trim started: every request up to it is served


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


ARENAS = 2  # the engine core's malloc arenas (limit_arenas)


def limit_arenas(n: int = ARENAS) -> bool:
    """Caps glibc's malloc arenas for this process at `n` (mallopt M_ARENA_MAX), unless MALLOC_ARENA_MAX is set
    (glibc has then applied the operator's value itself). Why: each thread that allocates gets an arena of its own,
    up to 8 per core, and a grammar compiled on a compile-queue thread leaves its freed pages spread over that
    thread's arena, which trimming does not all give back (four rounds of four 10,000-value enums in a core:
    +47 MB kept, peak +99 MB; with 2 arenas +2 MB kept, peak +55 MB). The engine core's big tensors are mmapped
    and do not go through the arenas. Returns whether the cap was set (False: not glibc, or MALLOC_ARENA_MAX)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-8, n))  # M_ARENA_MAX = -8 (malloc.h)


def request() -> None:
    """Asks for a trim soon; requests that arrive while one is pending are one trim."""
    global _thread, requested
    with _lock:
        requested += 1
        if _thread is None:
            trim = _malloc_trim()
            if trim is None:
                return
            _thread = threading.Thread(target=_run, args=(trim,), name="deepinfer-heap-trim", daemon=True)
            _thread.start()
    _wake.set()


def _run(trim) -> None:
    global trimmed_upto
    while True:
        _wake.wait()
        _wake.clear()
        upto = requested
        trim(0)
        trimmed_upto = upto
