"""DeviceWorker: the one thread that does the engine's tensor work when async scheduling is on.

On a GPU the launch is asynchronous by itself; on the CPU the "device" work is this thread. torch releases the GIL
inside its ops, so the engine's Python planning of the next step really overlaps the model's math. One thread
means steps (and state releases) execute strictly in the order they were submitted, which placeholder tokens rely
on. The model is also built on this thread: with torch's OpenMP backend every thread that runs parallel ops gets
its own OpenMP team, and two teams on the same cores were measured to make every step about 2x slower.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class DeviceWorker:
    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-device")

    def submit(self, fn: Callable, *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def call(self, fn: Callable, *args: Any) -> Any:
        return self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
