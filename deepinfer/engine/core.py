"""EngineCore: scheduler + cache manager + model runner + sampler, stepping in one loop.

Two loops over the same rooms:
- synchronous: plan step N, run it, fold its tokens in, plan step N+1 ... (the device waits for the CPU between
  steps);
- zero-overhead (async): launch step N on the device thread, then fold in step N-1's tokens and plan step N+1
  while step N runs. Plans made this way carry placeholders for the tokens of the step in flight, and a request
  that turns out to have finished in step N-1 wastes one row of step N whose token is dropped. Every sampled token
  depends only on the request's own tokens, seed and position, so the outputs are the same as the synchronous loop's.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable

from deepinfer.engine.backend import EngineBackend
from deepinfer.engine.cache_manager import CacheManager
from deepinfer.engine.grammars import GrammarCompilations
from deepinfer.engine.images import prepare_images
from deepinfer.engine.messages import AddRequest, CoreInfo, CoreOutputs, RequestUpdate, StepStats, request_error
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.options import EngineOptions
from deepinfer.engine.plan import StepPlan, StepResult
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.stopping import stopper_factory
from deepinfer.engine.worker import DeviceWorker


class EngineCore:
    """backend_factory: zero-argument callable returning the EngineBackend (the model is built by the thread that
    will run it)."""

    def __init__(self, backend_factory: Callable[[], EngineBackend], options: EngineOptions,
                 agree_budget: Callable[[int], int] | None = None):
        """agree_budget: maps this process's cache budget (bytes) to the one to use; the ranks of a context-parallel
        group agree on one (deepinfer.engine.lockstep) so that their schedulers see the same cache geometry."""
        self.options = options
        self.zero_overhead = options.zero_overhead_scheduling
        self._worker = DeviceWorker() if self.zero_overhead else None
        try:
            backend = self._worker.call(backend_factory) if self._worker else backend_factory()
        except BaseException:
            if self._worker is not None:
                self._worker.shutdown()
            raise
        self.backend = backend
        max_len = backend.max_position_embeddings
        if options.max_model_len is not None:
            max_len = min(max_len, options.max_model_len)
        budget = cache_budget(options, backend)
        if agree_budget is not None:
            budget = agree_budget(budget)
        self.runner = ModelRunner(backend, options.num_draft_tokens, options.confidence_temperature)
        if options.num_draft_tokens and self.runner.drafter is None:
            self._shutdown_worker()
            raise ValueError("decoding=dspark needs a checkpoint with DSpark draft layers (num_nextn_predict_layers "
                             "> 0, mtp.* tensors) loaded; this model has none (use decoding=plain)")
        speculative = self.runner.num_draft > 0
        extra = {"max_rollback": options.max_rollback} if options.max_rollback else {}
        if speculative:
            extra["drafts"] = True
        # prefix caching: a prompt's end-of-prompt checkpoint is taken after the step that ends the prompt, up to a
        # block past its boundary, instead of cutting the prompt there (a cut costs its request one more step)
        lag = options.block_size - 1 if options.prefix_caching else 0
        if lag:
            extra["checkpoint_lag"] = lag
        layout = backend.cache_layout(options.block_size, **extra)
        self.cache = CacheManager.from_budget(budget, layout.slot_bytes(), layout.block_bytes(), options.block_size,
                                              options.max_num_seqs, max_len, options.prefix_caching,
                                              options.prefix_checkpoint_fraction)
        # the runner owns the memory: every pool is allocated here, once, on the thread that runs the model
        alloc = (self.runner.allocate, self.cache.num_slots, self.cache.num_blocks, options.block_size, max_len,
                 not options.enforce_eager, options.cudagraph_batch_size_interval, options.max_rollback,
                 self.cache.checkpoint_slots, lag)
        try:
            self._worker.call(*alloc) if self._worker else alloc[0](*alloc[1:])
        except BaseException:
            if self._worker is not None:
                self._worker.shutdown()
            raise
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=max_len,
            vocab_size=backend.vocab_size,
            stopper=stopper_factory(backend.eos_token_id, backend.tokenizer),
            num_draft_tokens=self.runner.num_draft,
            planner=self._varlen_planner(options) if speculative and options.spec_varlen else None,
            checkpoint_interval=options.prefix_checkpoint_interval,
            checkpoint_lag=lag,
            replay_keep=backend.replay.keep if backend.replay is not None else 0,
        )
        self._inflight: tuple[StepPlan, Future, float] | None = None
        self.grammars = GrammarCompilations(backend, options)
        # Lockstep (deepinfer.engine.lockstep, data-parallel ranks whose model forwards are collectives): every
        # step() runs exactly one forward, a dummy one when it has nothing to launch.
        self.lockstep = False
        self._sync_grammars = False  # context parallel: compile on arrival, never timing-dependent (enter_lockstep)
        self._launched = False
        self._device_jobs: list[Future] = []  # dummy steps and after-step work queued behind the steps (async)

    def _shutdown_worker(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def _varlen_planner(self, options: EngineOptions):
        """Confidence-scheduled verification: the step-time curve (tokens -> ms) measured on this model now, or
        read from DEEPINFER_DECODE_PERF_CACHE_DIR when a run with the same model, device and sizes saved one."""
        from deepinfer.engine.spec_schedule import VarlenPlanner, load_or_profile_cost_curve

        cap = min(options.max_num_batched_tokens, self.cache.num_slots * (self.runner.num_draft + 1))
        sizes = sorted({min(cap, 1 << i) for i in range(cap.bit_length() + 1)})
        model = self.backend.model
        cfg = getattr(model, "config", None)
        key = {"model": repr(sorted(getattr(cfg, "raw", {}).items())), "device": self.backend.device,
               "dtype": str(getattr(model, "dtype", "")), "draft": self.runner.num_draft, "sizes": sizes,
               "graphs": not options.enforce_eager}
        run = (lambda n: self._worker.call(self.runner.profile_step, n)) if self._worker else self.runner.profile_step
        curve = load_or_profile_cost_curve(options.decode_perf_cache_dir, key, options.decode_perf_cache_ttl_s,
                                           run, sizes)
        return VarlenPlanner(curve, self.runner.num_draft)

    def info(self) -> CoreInfo:
        return CoreInfo(
            max_model_len=self.scheduler.max_model_len,
            capacity_tokens=self.cache.capacity_tokens,
            num_blocks=self.cache.num_blocks,
            block_size=self.cache.block_size,
            cache_description=self.cache.describe(),
            vocab_size=self.backend.vocab_size,
            eos_token_id=self.backend.eos_token_id,
            zero_overhead=self.zero_overhead,
        )

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, msg: AddRequest) -> RequestUpdate | None:
        """Queues the request; returns its final update at once if it can never run.

        The request is checked again here, whatever the frontend did: params may have been changed after they
        were built, and one malformed request must end alone instead of raising in the step loop for everyone."""
        error = request_error(msg)
        if error is None and self.backend.replay is not None and getattr(msg.params, "prompt_logprobs", False):
            error = self.backend.replay.prompt_logprobs_error()
        if error is not None:
            return RequestUpdate(msg.request_id, finish_reason="error", error=error)
        params = msg.params
        request = Request(msg.request_id, list(msg.prompt_ids), params, msg.seed, cache_salt=msg.cache_salt)
        if msg.images:
            error = self._images_error(msg)
            if error is None:
                try:
                    request.images = prepare_images(msg.images, request.prompt_ids, self._vision(),
                                                     self.backend.vocab_size)
                except ValueError as exc:
                    error = str(exc)
            if error is not None:
                return RequestUpdate(msg.request_id, finish_reason="error", error=error)
        try:
            update = self.scheduler.add(request)
        except Exception as exc:  # a check the rooms below forgot: still this request's error only
            self.scheduler.abort(msg.request_id)
            return RequestUpdate(msg.request_id, finish_reason="error", error=f"invalid request: {exc}")
        so_args = getattr(params, "so_args", None)
        if update is None and so_args:
            # Compiles in the pool's threads; the scheduler prefills meanwhile but samples only once it is ready.
            request.grammar_pending = True
            requests = self.scheduler.requests
            error = self.grammars.submit(msg.request_id, so_args, alive=lambda: msg.request_id in requests,
                                         client=msg.client)
            if error is not None:
                update = self.scheduler.fail(msg.request_id, error)
            elif self._sync_grammars:
                self.grammars.wait(msg.request_id)  # settled by the next step(), on every rank alike
        return update

    def _vision(self):
        return getattr(self.backend.model, "vision", None)

    def _images_error(self, msg: AddRequest) -> str | None:
        """Why this engine cannot take the request's images (layouts that do not run image spans), or None."""
        if self.runner.cp is not None:
            return ("image input with context parallel prefill is not supported yet (each rank would need the image "
                    "rows of its own share); allowed: context_parallel_size=1")
        return None

    def abort(self, request_id: int) -> RequestUpdate | None:
        update = self.scheduler.abort(request_id)
        if not self.has_work():
            self._release(self.scheduler.take_release())  # no step may come to carry the release
        return update

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- stepping ------------------------------------------------------------------------------------------
    def enter_lockstep(self, cp=None) -> None:
        """From now on every step() runs exactly one model forward (see `idle_step`), and a failed step ends the run
        instead of only its requests (the other ranks' collectives cannot be matched any more).

        cp (deepinfer.distributed.context_parallel.ContextParallel): this core is one of a context-parallel group whose
        cores get the same requests and must make the same decisions: prefill steps run model.forward(..., cp=cp),
        and a grammar is compiled before add_request returns, so when a request becomes sampleable never depends on
        a compiler thread's timing (which differs between ranks)."""
        self.lockstep = self.runner.lockstep = True
        if cp is not None:
            self.runner.cp = cp
            self._sync_grammars = self.grammars.synchronous = True

    def idle_step(self) -> CoreOutputs:
        """Lockstep: one forward without any sequence (ModelRunner.dummy_step), so that a rank with nothing to run
        still joins the step's collectives."""
        self.on_device(self.runner.dummy_step)
        return CoreOutputs([])

    def on_device(self, fn: Callable[[], object]) -> None:
        """Runs fn after every step launched so far, on the thread that runs the model (with async scheduling:
        queued behind them; its exception surfaces at a later step)."""
        if self._worker is None:
            fn()
            return
        self._reap_device_jobs()
        self._device_jobs.append(self._worker.submit(fn))

    def _reap_device_jobs(self) -> None:
        done = [f for f in self._device_jobs if f.done()]
        self._device_jobs = [f for f in self._device_jobs if not f.done()]
        for f in done:
            f.result()  # raises what the job raised

    def step(self) -> CoreOutputs:
        settled = self._settle_grammars()
        self._launched = False
        out = self._step_async() if self.zero_overhead else self._step_sync()
        if self.lockstep and not self._launched:
            self.idle_step()  # nothing launched (waiting for grammars, only folding the step in flight)
        if not self.has_work():
            self._release(self.scheduler.take_release())  # nothing further will carry them: drop states now
        if settled:
            out.updates[:0] = settled
        return out

    def _settle_grammars(self) -> list[RequestUpdate]:
        """Hands finished compilations to their requests (now they may be sampled); a grammar that failed or timed
        out ends only its own request."""
        updates = []
        for rid, state, error in self.grammars.settle():
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue  # aborted while compiling
            if error is not None:
                updates.append(self.scheduler.fail(rid, str(error), busy=getattr(error, "busy", False)))
            else:
                req.grammar_state, req.grammar_pending = state, False
        return updates

    def _idle_for_grammars(self, plan: StepPlan) -> bool:
        """A plan without rows is expected while every request left waits for its grammar: wait a little for a
        compilation instead of spinning (or declaring the scheduler stuck)."""
        if not self.grammars.num_pending:
            return False
        self._release(plan.release)
        self.grammars.wait_any(0.005)
        return True

    def _step_sync(self) -> CoreOutputs:
        if not self.scheduler.has_unfinished():
            return CoreOutputs([])
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        sched_s = time.perf_counter() - t0
        if not plan.rows:
            return CoreOutputs([] if self._idle_for_grammars(plan) else self._stuck(plan))
        self._launched = True
        result = self.runner.execute(plan)
        return self._fold(plan, result, sched_s)

    def _step_async(self) -> CoreOutputs:
        launched = None
        if self.scheduler.has_unfinished():
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            sched_s = time.perf_counter() - t0
            if plan.rows:
                launched = (plan, self._worker.submit(self.runner.execute, plan), sched_s)
                self._launched = True
            elif self._inflight is None:
                return CoreOutputs([] if self._idle_for_grammars(plan) else self._stuck(plan))
            elif plan.release:
                self._worker.submit(self.runner.release, plan.release)
        previous, self._inflight = self._inflight, launched
        if previous is None:
            return CoreOutputs([])
        plan, future, sched_s = previous
        return self._fold(plan, future.result(), sched_s)

    def _fold(self, plan: StepPlan, result: StepResult, sched_s: float) -> CoreOutputs:
        t0 = time.perf_counter()
        updates = self.scheduler.update(plan, result)
        stats = StepStats(
            step_id=plan.step_id,
            num_rows=len(plan.rows),
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_preempted=plan.num_preempted,
            device_start=result.t_start,
            device_end=result.t_end,
            schedule_s=sched_s,
            update_s=time.perf_counter() - t0,
            prepare_s=result.prepare_s,
            cache_utilization=self.cache.utilization,
            graph=result.graph,
            draft_graph=result.draft_graph,
            replay_rows_saved=result.replay_rows_saved,
            num_draft_tokens=result.num_draft_tokens,
            num_accepted_tokens=result.num_accepted_tokens,
            accepted_lengths=[len(s.accepted) for s in result.samples if s.num_draft_tokens],
            prefix_query_tokens=plan.prefix_query_tokens,
            prefix_hit_tokens=plan.prefix_hit_tokens,
            prefix_cache=self.cache.prefix_stats(),
        )
        planner = self.scheduler.planner
        if planner is not None and result.error is None and not plan.num_prefill_tokens:
            planner.update_runtime(len(plan.rows), plan.num_decode_tokens, (result.t_end - result.t_start) * 1e3)
        return CoreOutputs(updates, [stats])

    def _stuck(self, plan: StepPlan) -> list[RequestUpdate]:
        """A plan with no rows while requests wait and nothing runs would repeat forever: end them instead."""
        self._release(plan.release)
        msg = "the scheduler could not make progress (no request fits the cache); this is an engine bug"
        updates = []
        for rid in list(self.scheduler.requests):
            self.scheduler.abort(rid)
            updates.append(RequestUpdate(rid, finish_reason="error", error=msg))
        return updates

    def _release(self, request_ids: list[int]) -> None:
        if not request_ids:
            return
        if self._worker is not None:
            self._worker.submit(self.runner.release, request_ids)
        else:
            self.runner.release(request_ids)

    def close(self) -> None:
        if self._inflight is not None:
            self._inflight[1].result()
            self._inflight = None
        for job in self._device_jobs:
            job.exception()  # waits; what it raised no longer matters
        self._device_jobs = []
        if self._worker is not None:
            self._worker.call(self.runner.close)
            self._worker.shutdown()
        else:
            self.runner.close()
        self.grammars.close()


def cache_budget(options: EngineOptions, backend) -> int:
    """Bytes for the caches: cache.memory_budget when set, else what the loaded model leaves of cache.memory_limit
    (resolved once, in the resolve step, from cache.memory_fraction of the device's total memory)."""
    if options.memory_budget is not None:
        return options.memory_budget
    if options.memory_limit is None:
        raise ValueError("cache.memory_budget and cache.memory_limit are both null: EngineOptions come from "
                         "resolved settings (deepinfer.config.resolve), which set memory_limit")
    in_use = memory_in_use(backend)
    budget = options.memory_limit - in_use
    if budget <= 0:
        raise ValueError(f"cache.memory_limit={options.memory_limit} B (cache.memory_fraction of the device's "
                         f"memory) leaves the caches nothing: the model takes {in_use} B; allowed: a larger "
                         "cache.memory_fraction, or cache.memory_budget")
    return budget


def memory_in_use(backend) -> int:
    """Bytes the loaded model takes on its device: the accelerator's allocated memory (weights and buffers, as
    the allocator counts it), or on the CPU the model's parameters and buffers."""
    import torch

    device = torch.device(str(backend.device))
    accel = getattr(torch, device.type, None) if device.type != "cpu" else None
    if accel is not None and hasattr(accel, "memory_allocated"):
        return int(accel.memory_allocated(device))
    model = getattr(backend, "model", None)
    if model is None or not hasattr(model, "parameters"):
        return 0
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
