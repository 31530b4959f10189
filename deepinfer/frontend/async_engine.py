"""AsyncEngine: the asyncio frontend loop, behind the OpenAI server.

The same input processor (validation, the seed rule) and output processor (the DecodeStream detokenizer, the
stop-string cut) as LLMEngine, with special tokens kept in the text (deepseek_recipe's stream parser reads
`</think>` and the tool-call markup). One asyncio task is the loop: it hands what the event loop queued (adds,
aborts) to the engine client and takes the core's next outputs, then folds them into the requests' states and wakes
their streams. The client (deepinfer/engine/client.py: add, abort, get) blocks and is not thread-safe (one zmq
socket), so each exchange with it runs on one dedicated executor thread, one at a time; nothing on the event loop
ever blocks on the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deepinfer.engine.client import EngineDeadError, InprocClient
from deepinfer.engine.messages import AddRequest
from deepinfer.frontend.input_processor import InputProcessor
from deepinfer.frontend.output_processor import OutputProcessor, RequestState

log = logging.getLogger("deepinfer.serving")

POLL_S = 0.005  # how long one get() waits: bounds the delay a new request or abort sees before it is sent
IDLE_WAIT_S = 0.05  # an in-process core with no work: wait this long for a submission before stepping again
LATE_BEATS, LATE_MIN_S = 4, 1.0  # health(): a heartbeat older than 4 intervals (and 1 s) is late


@dataclass
class StreamOutput:
    """What arrived for one request since its stream last looked: new token ids, their new text (special tokens
    kept; a final stop token left out) and how many tokens that text accounts for; finish_reason on the last.
    logprobs: one (logprob, top_logprobs) entry per new token id (None where the request asked for none);
    prompt_logprobs: the prompt's TokenLogprob list (entry 0 None), on the first output that has it.
    num_cached_tokens: prompt tokens found in the prefix cache (known from the request's first tokens on)."""

    token_ids: list[int]
    text: str
    num_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    busy: bool = False  # the error is a refusal for load (RequestUpdate.busy): retry later


@dataclass
class EngineStream:
    """One request's outputs, in order, as the loop folded them in."""

    state: RequestState
    arrival: float = field(default_factory=time.perf_counter)
    _news: asyncio.Event = field(default_factory=asyncio.Event)
    _taken: int = 0  # tokens (and their logprob entries) handed out so far
    _prompt_lp_sent: bool = False

    @property
    def request_id(self) -> int:
        return self.state.engine_id

    @property
    def finished(self) -> bool:
        return self.state.finished

    def append(self, state: RequestState) -> None:
        """The output processor's news of this request (the stream is the state's inbox)."""
        self._news.set()

    async def next(self) -> StreamOutput:
        """Waits for news; what arrived since the last call (the last one has finish_reason set)."""
        await self._news.wait()
        self._news.clear()
        st = self.state
        text, count = st.text_delta()
        new = st.take_new()
        logprobs = st.logprobs[self._taken:self._taken + len(new)] if st.logprobs else None
        self._taken += len(new)
        prompt_lp = None
        if st.prompt_logprobs is not None and not self._prompt_lp_sent:
            prompt_lp, self._prompt_lp_sent = st.prompt_logprobs, True
        return StreamOutput(new, text, count, st.finish_reason, st.error, logprobs, prompt_lp, st.num_cached_tokens,
                            st.busy)


class AsyncEngine:
    """client: an engine client (ProcessClient or InprocClient) already started; this object owns it from now on.
    seed: runtime.seed (requests without seq_seed draw with child_seed(seed, request id); None: a random seed).
    tokenizer: for the streamed text. on_outputs(updates, stats, now): called on the event loop for every batch."""

    def __init__(self, client, seed: int | None = None, on_outputs=None, tokenizer=None):
        self.client = client
        self.info = client.info
        self.on_outputs = on_outputs
        self.input = InputProcessor(None, seed)  # token ids only: the server renders and encodes its prompts
        self.output = OutputProcessor(tokenizer, self.info.eos_token_id, skip_special_tokens=False)
        self.dead: str | None = None  # set when the core is gone: new requests are refused (503)
        self._ids = itertools.count()
        self._adds: list[AddRequest] = []
        self._aborts: list[int] = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-engine-client")
        self._wake: asyncio.Event | None = None
        self._changed = asyncio.Event()  # set whenever outputs were folded in (wait_for_change)
        self._task: asyncio.Task | None = None

    # ---- event-loop side -----------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="deepinfer-engine-loop")

    def health(self) -> str | None:
        """None while the engine serves; otherwise why not: it is dead, or its core's heartbeat is late (more than
        LATE_BEATS heartbeat intervals old, at least LATE_MIN_S: a stopped or hung core, reported long before the
        client's engine.heartbeat_timeout declares it dead)."""
        if self.dead is not None:
            return self.dead
        age_of = getattr(self.client, "heartbeat_age", None)
        age = age_of() if age_of is not None else None
        if age is not None:
            late = max(LATE_MIN_S, LATE_BEATS * self.client.options.heartbeat_interval_s)
            if age > late:
                return (f"the engine core's heartbeat is {age:.1f} s old (late after {late:g} s): it is stopped or "
                        "hung")
        return None

    @property
    def num_in_flight(self) -> int:
        return len(self.output.states)

    def submit(self, prompt_ids: list[int], params) -> EngineStream:
        """Queues one request (params.n == 1); its outputs arrive through the returned stream's next() (the last
        one has finish_reason set; one the input processor refuses ends at once with "error"). Call it on the
        event loop."""
        streams = self.submit_all(prompt_ids, params)
        if len(streams) != 1:
            raise ValueError(f"submit takes one sample (n=1); got {len(streams)}: use submit_all")
        return streams[0]

    def submit_all(self, prompt_ids: list[int], params, images: list | None = None,
                   cache_salt: str | None = None, client: str = "") -> list[EngineStream]:
        """Queues the params.n samples of one prompt (the input processor's seed rule: sample i draws with
        child_seed(seed, i)); one stream per sample, or one that ends at once with "error". images: the
        messages.ImageInput of each image span in prompt_ids (already expanded: frontend/images.py). cache_salt:
        the request's prefix-cache salt (InputProcessor.process). client: who sent it (AddRequest.client: grammar
        compilations are shared fairly and bounded per client)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        streams = []
        for inp in self.input.process(0, None, list(prompt_ids), params, spans=images, cache_salt=cache_salt):
            st = self.output.new_state(inp, next(self._ids))
            stream = EngineStream(st)
            st.inbox = stream  # the loop's news of this request wake the stream
            streams.append(stream)
            if st.finished:  # refused by the input processor
                stream._news.set()
                continue
            self._adds.append(AddRequest(st.engine_id, inp.prompt_ids, inp.params, inp.seed, inp.images,
                                         inp.cache_salt, client))
        self._wake_loop()
        return streams

    def abort(self, stream: EngineStream) -> None:
        """Stops a request that is still running (a client that went away); its cache is freed by the core."""
        if not stream.finished and stream.request_id in self.output.states:
            self._aborts.append(stream.request_id)
            self._wake_loop()

    def abort_all(self) -> None:
        """Stops every request in flight (the server's drain at shutdown)."""
        self._aborts.extend(self.output.states)
        self._wake_loop()

    async def wait_for_change(self, timeout: float) -> None:
        """Returns when the loop next folds in outputs (or the engine stops), or after `timeout` seconds."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            pass

    def _wake_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        inproc = isinstance(self.client, InprocClient)
        try:
            while True:
                adds, aborts, self._adds, self._aborts = self._adds, self._aborts, [], []
                out = await loop.run_in_executor(self._executor, self._exchange, adds, aborts)
                if out is None:
                    if inproc and not (self._adds or self._aborts):  # get() returned at once: wait for work
                        try:
                            await asyncio.wait_for(self._wake.wait(), IDLE_WAIT_S)
                        except asyncio.TimeoutError:
                            pass
                    self._wake.clear()
                    continue
                now = time.perf_counter()
                if self.on_outputs is not None:
                    self.on_outputs(out.updates, out.stats, now)
                self.output.process(out.updates, now)
                self._changed.set()
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._stop(str(exc).splitlines()[0] if str(exc) else "the engine core died")
        except Exception as exc:  # a bug here must not leave requests waiting forever
            log.exception("engine loop failed")
            self._stop(f"the engine frontend failed: {type(exc).__name__}: {exc}")

    def _exchange(self, adds: list[AddRequest], aborts: list[int]):
        """On the client's thread: send what was queued, then wait briefly for the core's next outputs."""
        if adds:
            self.client.add(adds)
        if aborts:
            self.client.abort(aborts)
        return self.client.get(timeout=POLL_S)

    def _stop(self, message: str) -> None:
        self.dead = message
        log.error("engine stopped: %s", message)
        self.output.fail_all(message)
        self._changed.set()

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the loop, then the engine core (process killed and reaped if it does not stop in seconds)."""
        if self._task is not None and not self._task.done():
            loop = self._task.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._task.cancel)
        self._executor.shutdown(wait=True)  # an exchange in flight ends within one step
        self.client.close()
