"""LLMEngine: the synchronous frontend loop, behind LLM.generate and LLM.generate_iter.

`add_request` puts requests through the input processor (validation, seeds, n) and sends them to the engine core;
`step` takes one batch of the core's updates and folds each into its RequestState (the output processor: text,
RequestOutput). `stream` is the loop itself, a generator: it yields tokens as they arrive and then one output per
prompt. LLM.generate_iter returns it and LLM.generate drains it with list(), so no thread runs it and the core's
client is called from the frame right below the caller's. Several streams may be open at once: each state goes to
the inbox of the stream that owns it, whichever stream's step brought its news.

The engine core (scheduler, cache manager, model runner, sampler) runs in its own process by default
(options.process == "subprocess") or in this one ("inproc", for tests and debugging).
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from contextlib import AbstractContextManager
from typing import Callable, Iterable, Iterator, Sequence

from deepinfer.engine.client import EngineDeadError, InprocClient
from deepinfer.engine.make_client import client_for, make_client
from deepinfer.engine.messages import AddRequest
from deepinfer.engine.metrics import RunMetrics
from deepinfer.engine.options import EngineOptions
from deepinfer.frontend.images import ImagePrompts
from deepinfer.frontend.input_processor import (EngineInput, InputProcessor, normalize_prompts, per_prompt,
                                                per_prompt_images)
from deepinfer.frontend.output_processor import OutputProcessor, RequestState, request_outputs
from deepinfer.outputs import RequestOutput, StreamUpdate

__all__ = ["LLMEngine", "EngineDeadError"]

log = logging.getLogger("deepinfer.engine")

_OUTPUT = operator.attrgetter("output")


class LLMEngine(AbstractContextManager):
    """Built from resolved Settings: `LLMEngine.for_settings(settings, tokenizer)` (the one construction path: the
    core builds its backend with SettingsBackend(settings)). backend_factory: a zero-argument callable returning an
    EngineBackend, run by the engine core (SettingsBackend(settings); with engine.process=inproc any callable, e.g.
    one wrapping a model built in memory). tokenizer: a tokenizers.Tokenizer, for text prompts and output text
    (None: token ids only, text is "")."""

    def __init__(self, backend_factory, options: EngineOptions, tokenizer=None, client=None, vision=None):
        """client: a started client (deepinfer.engine.make_client, as for_settings passes); default: one for
        `backend_factory` by options.process. options: EngineOptions.for_settings(settings). vision: the model's
        VisionConfig (ModelCard.vision) for prompts with images; None: images are refused in one line."""
        self.options = options
        self.tokenizer = tokenizer
        self.client = client if client is not None else client_for(backend_factory, self.options)
        self.info = self.client.info
        mode = "async" if self.info.zero_overhead else "sync"
        log.info("engine ready (%s, %s scheduling, max_model_len %d): %s", self.options.process, mode,
                 self.info.max_model_len, self.info.cache_description)
        self._ids = itertools.count()  # engine-internal ids: unique for the engine's lifetime
        encode = None if tokenizer is None else (lambda text: tokenizer.encode(text).ids)
        self.input = InputProcessor(encode, self.options.seed, ImagePrompts(vision))
        self.output = OutputProcessor(tokenizer, self.info.eos_token_id)
        self.last_metrics: dict | None = None

    @classmethod
    def for_settings(cls, settings, tokenizer=None, vision=None, **overrides) -> "LLMEngine":
        """The engine LLM uses: from resolved Settings (deepinfer.config.schema.Settings), options overridden by
        field name. The engine core builds the model from the settings (in this process or its own); the frontend
        holds only `tokenizer`, for text prompts and output text (None: token ids only), and `vision`, the
        model's VisionConfig for prompts with images (None: refused)."""
        options = EngineOptions.for_settings(settings, **overrides)
        return cls(None, options, tokenizer, make_client(settings, options), vision)

    # ---- the loop ------------------------------------------------------------------------------------------
    def add_request(self, inp: EngineInput, run: RunMetrics | None = None, inbox: list | None = None) -> RequestState:
        """Starts one processed request (one that carries an error is finished at once and never sent)."""
        return self.add_requests([inp], run, inbox)[0]

    def add_requests(self, inputs: list[EngineInput], run: RunMetrics | None = None,
                     inbox: list | None = None) -> list[RequestState]:
        """add_request for many, sent to the core in one message."""
        states = [self.output.new_state(inp, next(self._ids), run, inbox) for inp in inputs]
        submit = [AddRequest(st.engine_id, st.input.prompt_ids, st.input.params, st.input.seed, st.input.images,
                             st.input.cache_salt) for st in states if not st.finished]
        if submit:
            self.client.add(submit)
        return states

    def abort(self, states: Iterable[RequestState]) -> None:
        """Stops following these requests and tells the core to drop them."""
        ids = [st.engine_id for st in states if self.output.states.pop(st.engine_id, None) is not None]
        if ids:
            self.client.abort(ids)

    def has_unfinished(self) -> bool:
        return bool(self.output.states)

    def step(self, timeout: float = 1.0, run: RunMetrics | None = None) -> None:
        """One batch of the core's updates folded in (each changed state is appended to its inbox). run: where the
        batch's step stats go."""
        self._fold(self.client.get(timeout=timeout), run)

    def _fold(self, out, run: RunMetrics | None) -> None:
        if out is None:
            if self.output.states and isinstance(self.client, InprocClient) and not self.client.core.has_work():
                raise RuntimeError(f"engine bug: requests {sorted(self.output.states)} were never answered")
            return
        if run is not None:
            run.steps.extend(out.stats)
        self.output.process(out.updates, time.perf_counter())

    def stream(self, prompts=None, sampling_params=None, *, prompt_token_ids=None, use_tqdm: bool = False,
               tokens: bool = True, on_update: Callable[[int, list[int]], None] | None = None,
               request_ids: Sequence[int] | None = None, default_params=None,
               multi_modal_data=None) -> Iterator[StreamUpdate]:
        """The loop. Yields StreamUpdate(index, new token ids) as tokens arrive (tokens=True; sample 0 of each
        prompt), then one StreamUpdate per prompt with `output` set, in input order. on_update(index, new ids) is
        called for the same tokens, from this loop. prompts / prompt_token_ids: see input_processor.normalize_prompts;
        sampling_params: one for all or one per prompt (None: default_params()). request_ids: the caller's ids
        (default: the frontend's running count). multi_modal_data: DeepInfer's images, a dict for one prompt or
        one dict (or None) per prompt (input_processor.per_prompt_images). Leaving the generator early (close, an exception here or in
        on_update) aborts the unfinished requests; the exception carries `finished_outputs` (what had finished)
        and, for EngineDeadError, `outputs` (every prompt, unfinished ones as errors)."""
        items = normalize_prompts(prompts, prompt_token_ids)
        params = per_prompt(sampling_params, len(items), default_params)
        images = per_prompt_images(multi_modal_data, len(items))
        run, inbox = RunMetrics(), []
        states = self.add_requests(self.input.process_all(items, params, request_ids, images), run, inbox)
        live = {st.engine_id for st in states if not st.finished}
        bar = _progress(len(states), use_tqdm)
        bar.update(len(states) - len(live))
        try:
            while live:
                if not inbox:
                    self._fold(self.client.get(timeout=1.0), run)  # step(), one frame less to the model
                news, inbox[:] = list(inbox), []
                for st in news:
                    new = st.take_new()
                    if st.finished and st.engine_id in live:
                        live.discard(st.engine_id)
                        bar.update(1)
                    if new and st.input.sample == 0:
                        if on_update is not None:
                            on_update(st.input.index, new)
                        if tokens:
                            yield StreamUpdate(st.input.index, new)
        except BaseException as exc:  # GeneratorExit too: the consumer left
            self._abort_quietly(states)  # e.g. KeyboardInterrupt: the core stops working on them
            # what had finished is not lost: the CLI writes these on Ctrl-C
            exc.finished_outputs = request_outputs(states, only_finished=True)
            if isinstance(exc, EngineDeadError):  # every request, in order; the unfinished ones end with its error
                for st in states:
                    if not st.finished:
                        st.fail(str(exc))
                exc.outputs = request_outputs(states)
            raise
        finally:
            bar.close()
        for st in states:
            run.on_finish(st.engine_id, st.finish_reason)
        self.last_metrics = run.summary()
        for i, out in enumerate(request_outputs(states)):
            yield StreamUpdate(i, [], out)

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling_params,
        use_tqdm: bool = True,
        on_update: Callable[[int, list[int]], None] | None = None,
        prompts: Sequence[str | None] | None = None,
        request_ids: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order; a request that cannot run comes back with finish_reason="error"
        and a message. sampling_params: one SamplingParams for all prompts or one per prompt (n > 1: the samples
        are in RequestOutput.samples). on_update(index, new_token_ids) is called as tokens arrive (streaming).
        prompts: the texts, copied into the outputs. request_ids: the caller's ids, copied into the outputs and,
        for params without seq_seed, the seed source (child_seed(runtime.seed, request_id), as the sequential
        runner does); default: a running count from 0. Per-run metrics land in `self.last_metrics`."""
        ids = [_as_list(p) for p in prompt_token_ids]
        texts = list(prompts) if prompts is not None else [None] * len(ids)
        if len(texts) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(texts)} texts")
        items = [{"prompt": text, "prompt_token_ids": p} for text, p in zip(texts, ids)]
        return list(map(_OUTPUT, self.stream(items, sampling_params, use_tqdm=use_tqdm, tokens=False,
                                             on_update=on_update, request_ids=request_ids)))

    def _abort_quietly(self, states: list[RequestState]) -> None:
        try:
            self.abort(st for st in states if not st.finished)
        except Exception:  # the core is gone: nothing left to stop
            pass

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        self.client.close()

    def __exit__(self, *exc):
        self.close()


def _as_list(ids):
    try:
        return list(ids)
    except TypeError:  # not a sequence: the input processor answers that request alone with an error
        return ids


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
