"""LLM.generate_iter: the streaming generate as an iterator.

The engine's frontend loop is synchronous and reports tokens through a callback; the iterator runs that loop in
one helper thread and hands the callback's updates over a queue. Leaving the iterator early sets a flag the
callback sees on its next call: it raises, and the frontend loop aborts the unfinished requests (the engine core
frees their cache) before the helper thread ends; the iterator waits for that, so nothing runs on after it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(frozen=True)
class StreamUpdate:
    """index: the prompt's position in the input. token_ids: tokens new since the last update of that prompt.
    output: None while it runs; the final RequestOutput once everything has finished (one update per prompt)."""

    index: int
    token_ids: list[int]
    output: Any = None


class _Stopped(Exception):
    """Raised inside the engine's callback when the consumer left the iterator."""


_DONE = object()


def stream_generate(generate, prompts, sampling_params, prompt_token_ids) -> Iterator[StreamUpdate]:
    updates: queue.Queue = queue.Queue()
    stop = threading.Event()
    result: dict = {}

    def on_update(index: int, new_ids: list[int]) -> None:
        if stop.is_set():
            raise _Stopped()
        updates.put(StreamUpdate(index, list(new_ids)))

    def run() -> None:
        try:
            result["outputs"] = generate(prompts, sampling_params, use_tqdm=False, prompt_token_ids=prompt_token_ids,
                                         on_update=on_update)
        except BaseException as exc:  # handed to the consumer's thread
            result["error"] = exc
        finally:
            updates.put(_DONE)

    worker = threading.Thread(target=run, name="deepinfer-generate-iter", daemon=True)
    worker.start()
    try:
        while (item := updates.get()) is not _DONE:
            yield item
        if "error" in result:
            raise result["error"]
        for i, out in enumerate(result["outputs"]):
            yield StreamUpdate(i, [], out)
    finally:
        stop.set()
        worker.join()
