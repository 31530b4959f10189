"""LLMEngine: the frontend. Validates and submits requests, follows the engine core's updates, detokenizes,
shows progress, and assembles one output per request in input order.

The engine core (scheduler, cache manager, model runner, sampler) runs in its own process by default
(options.process == "subprocess") or in this one ("inproc", for tests and debugging).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Sequence

from deepinfer.engine.client import EngineDeadError, InprocClient
from deepinfer.engine.make_client import client_for, make_client
from deepinfer.engine.messages import AddRequest, RequestUpdate
from deepinfer.engine.metrics import RunMetrics
from deepinfer.engine.options import EngineOptions
from deepinfer.outputs import RequestMetrics, RequestOutput, TokenLogprob
from deepinfer.sampling.params import params_error

__all__ = ["LLMEngine", "EngineDeadError"]

log = logging.getLogger("deepinfer.engine")


class _Tracked:
    """Frontend-side record of one submitted request."""

    __slots__ = ("index", "user_id", "prompt", "prompt_ids", "params", "token_ids", "logprobs", "prompt_logprobs",
                 "finish_reason", "error", "metrics", "num_draft_tokens", "num_accepted_tokens")

    def __init__(self, index, user_id, prompt, prompt_ids, params):
        self.index, self.user_id, self.prompt, self.prompt_ids, self.params = index, user_id, prompt, prompt_ids, params
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.finish_reason = self.error = None
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids))


class LLMEngine:
    """backend_factory: picklable zero-argument callable returning an EngineBackend, run in the engine process
    (e.g. ModelDirBackend(path)). tokenizer: anything with decode(ids, skip_special_tokens=...), for output text
    (None: text is "")."""

    def __init__(self, backend_factory, options: EngineOptions, tokenizer=None, client=None):
        """client: a started client (deepinfer.engine.make_client, as for_settings passes); default: one for
        `backend_factory` by options.process. options: EngineOptions.for_settings(settings)."""
        self.options = options
        self.tokenizer = tokenizer
        self.client = client if client is not None else client_for(backend_factory, self.options)
        self.info = self.client.info
        mode = "async" if self.info.zero_overhead else "sync"
        log.info("engine ready (%s, %s scheduling, max_model_len %d): %s", self.options.process, mode,
                 self.info.max_model_len, self.info.cache_description)
        self._ids = itertools.count()  # engine-internal ids: unique for the engine's lifetime
        self._user_ids = itertools.count()  # the default caller ids
        self.last_metrics: dict | None = None

    @classmethod
    def for_settings(cls, settings, program=None, **overrides) -> "LLMEngine":
        """The engine LLM uses: from resolved Settings (deepinfer.config.schema.Settings). In a subprocess the
        engine builds its own StepProgram from the settings; in-process it reuses `program` when given. Text comes
        from the program's tokenizer (or none)."""
        options = EngineOptions.for_settings(settings, **overrides)
        tokenizer = getattr(getattr(program, "tokenize", None), "tokenizer", None)
        return cls(None, options, tokenizer, make_client(settings, options, program))

    # ---- generation ----------------------------------------------------------------------------------------
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
        and a message. sampling_params: one SamplingParams for all prompts or one per prompt. on_update(index,
        new_token_ids) is called as tokens arrive (streaming). prompts: the texts, copied into the outputs.
        request_ids: the caller's ids, copied into the outputs and, for params without seq_seed, the seed source
        (child_seed(runtime.seed, request_id)); default: a running count from 0.
        Per-run metrics land in `self.last_metrics`."""
        ids = list(prompt_token_ids)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(ids)
        texts = list(prompts) if prompts is not None else [None] * len(ids)
        user_ids = list(request_ids) if request_ids is not None else [next(self._user_ids) for _ in ids]
        if not len(params) == len(texts) == len(ids) == len(user_ids):
            raise ValueError(f"{len(ids)} prompts but {len(params)} sampling params, {len(texts)} texts, {len(user_ids)} ids")
        metrics = RunMetrics()
        tracked: dict[int, _Tracked] = {}
        submit: list[AddRequest] = []
        for i, (prompt, p, text, uid) in enumerate(zip(ids, params, texts, user_ids)):
            rid = next(self._ids)
            t = tracked[rid] = _Tracked(i, uid, text, list(prompt), p)
            error = self._frontend_error(t.prompt_ids, p)
            if error:
                t.finish_reason, t.error = "error", error
            else:
                submit.append(AddRequest(rid, t.prompt_ids, p, self._seed(p, uid)))
            metrics.on_submit(rid, len(t.prompt_ids))
        bar = _progress(len(ids), use_tqdm)
        bar.update(len(ids) - len(submit))
        pending = {a.request_id for a in submit}
        if submit:
            self.client.add(submit)
        try:
            while pending:
                out = self.client.get(timeout=1.0)
                if out is None:
                    if isinstance(self.client, InprocClient) and not self.client.core.has_work():
                        raise RuntimeError(f"engine bug: requests {sorted(pending)} were never answered")
                    continue
                now = time.perf_counter()
                metrics.steps.extend(out.stats)
                for upd in out.updates:
                    if upd.request_id not in pending:
                        continue
                    self._apply(tracked[upd.request_id], upd, metrics, now, on_update)
                    if upd.finish_reason is not None:
                        pending.discard(upd.request_id)
                        bar.update(1)
        except BaseException as exc:
            self._abort_quietly(pending)  # e.g. KeyboardInterrupt: the core stops working on them
            # what had finished is not lost: the CLI writes these on Ctrl-C
            exc.finished_outputs = [self._assemble(t) for t in sorted(tracked.values(), key=lambda t: t.index)
                                    if t.finish_reason is not None]
            if isinstance(exc, EngineDeadError):  # every request, in order; the unfinished ones end with its error
                for t in tracked.values():
                    if t.finish_reason is None:
                        t.finish_reason, t.error = "error", str(exc)
                exc.outputs = [self._assemble(t) for t in sorted(tracked.values(), key=lambda t: t.index)]
            raise
        finally:
            bar.close()
        for rid, t in tracked.items():
            metrics.on_finish(rid, t.finish_reason)
        self.last_metrics = metrics.summary()
        return [self._assemble(t) for t in sorted(tracked.values(), key=lambda t: t.index)]

    def _seed(self, params: Any, user_id: int) -> int:
        from deepinfer.sampling import child_seed, request_seed

        if getattr(params, "seq_seed", None) is None and self.options.seed is not None:
            return child_seed(self.options.seed, user_id)
        return request_seed(getattr(params, "seq_seed", None))

    def _frontend_error(self, prompt_ids: list[int], params: Any) -> str | None:
        if not all(type(t) is int for t in prompt_ids):
            return "prompt token ids must be integers"
        error = params_error(params)  # again: fields may have been set after the params were built
        if error is not None:
            return error
        if params.n != 1:
            return "n > 1 is expanded by the caller (one request per sample, seq_seed from sampling.child_seed)"
        return None

    def _apply(self, t: _Tracked, upd: RequestUpdate, metrics: RunMetrics, now: float, on_update) -> None:
        if upd.prompt_logprobs is not None:
            t.prompt_logprobs = [None if s is None else TokenLogprob(s.token_id, s.logprob, s.top_logprobs) for s in upd.prompt_logprobs]
        t.num_draft_tokens += upd.num_draft_tokens
        t.num_accepted_tokens += upd.num_accepted_tokens
        if upd.token_ids:
            t.token_ids += upd.token_ids
            t.logprobs += upd.logprobs
            metrics.on_tokens(upd.request_id, len(upd.token_ids), now)
            if t.metrics.first_token_time is None:
                t.metrics.first_token_time = now
            if on_update is not None:
                on_update(t.index, list(upd.token_ids))
        if upd.finish_reason is not None:
            t.finish_reason, t.error = upd.finish_reason, upd.error
            t.metrics.finish_time = now

    def _assemble(self, t: _Tracked) -> RequestOutput:
        text = self._detokenize(t) if self.tokenizer is not None and t.token_ids else ""
        logprobs = None
        if t.logprobs and all(lp is not None for lp in t.logprobs):
            logprobs = [TokenLogprob(tok, lp[0], lp[1]) for tok, lp in zip(t.token_ids, t.logprobs)]
        if t.metrics.finish_time is None:
            t.metrics.finish_time = t.metrics.arrival_time  # rejected by the frontend
        t.metrics.num_output_tokens = len(t.token_ids)
        return RequestOutput(
            request_id=t.user_id,
            prompt=t.prompt,
            prompt_token_ids=t.prompt_ids,
            text=text,
            token_ids=list(t.token_ids),
            finish_reason=t.finish_reason,
            error=t.error,
            logprobs=logprobs,
            prompt_logprobs=t.prompt_logprobs,
            num_draft_tokens=t.num_draft_tokens,
            num_accepted_tokens=t.num_accepted_tokens,
            metrics=t.metrics,
        )

    def _detokenize(self, t: _Tracked) -> str:
        """The same StopChecker the engine core stops with, so the text ends where the core stopped (stop string
        cut, final stop token left out)."""
        from deepinfer.sampling.stop import StopChecker

        checker = StopChecker(t.params, self.tokenizer, self.info.eos_token_id)
        for tok in t.token_ids:
            if checker.finished:
                break
            checker.append(tok)
        if not checker.finished:  # aborted or errored midway: show everything generated
            return self.tokenizer.decode(t.token_ids, skip_special_tokens=True)
        return checker.text

    def _abort_quietly(self, request_ids) -> None:
        try:
            if request_ids:
                self.client.abort(list(request_ids))
        except Exception:
            pass

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
