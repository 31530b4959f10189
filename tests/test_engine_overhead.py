"""Scheduling overhead: async (zero-overhead) scheduling plans the next step while the current one runs on the
device, for the same outputs as synchronous scheduling. Checked by the order of events (a step's plan made while the
previous step runs), not by timings a shared machine's load can flip; what the overlap buys in device gap and
bookkeeping share is measured by benchmarks/throughput.py."""

from __future__ import annotations

import threading
from pathlib import Path

from deepinfer.frontend import LLMEngine
from deepinfer.sampling import SamplingParams
from options_helpers import settings_for

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")
HANG_S = 60  # bounds a hang only: the next plan comes within milliseconds


class StepOrder:
    """Spies on an in-process core: for each executed step, whether the scheduler made another plan before the step
    ended. wait_for_next_plan: a step does not end before a later plan is made (or HANG_S passes), so a planner that
    overlaps is seen to overlap however fast the step."""

    def __init__(self, core, wait_for_next_plan: bool):
        self.overlapped, self.executed = 0, 0
        self._plans, self._number = 0, {}
        self._changed = threading.Condition()
        execute, schedule = core.runner.execute, core.scheduler.schedule

        def spied_schedule():
            plan = schedule()
            with self._changed:
                self._plans += 1
                self._number[id(plan)] = self._plans
                self._changed.notify_all()
            return plan

        def spied_execute(plan):
            result = execute(plan)
            with self._changed:
                mine = self._number[id(plan)]
                if wait_for_next_plan:
                    self._changed.wait_for(lambda: self._plans > mine, timeout=HANG_S)
                self.executed += 1
                self.overlapped += self._plans > mine
            return result

        core.scheduler.schedule, core.runner.execute = spied_schedule, spied_execute


def run(zero_overhead: bool):
    settings = settings_for(MODEL, process="inproc", zero_overhead_scheduling=zero_overhead, max_num_seqs=32,
                            memory_budget=1 << 24)
    prompts = [[0] + [3 + (7 * i + j) % 500 for j in range(6 + i % 5)] for i in range(32)]
    with LLMEngine.for_settings(settings) as engine:
        order = StepOrder(engine.client.core, wait_for_next_plan=zero_overhead)
        outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        return [o.token_ids for o in outputs], order, engine.last_metrics


def test_async_scheduling_plans_each_next_step_while_the_current_one_runs_with_identical_outputs():
    sync_tokens, sync_order, sync = run(zero_overhead=False)
    async_tokens, async_order, asyn = run(zero_overhead=True)
    assert async_tokens == sync_tokens
    assert sync_order.executed == sync["steps"] > 0 and sync_order.overlapped == 0
    assert async_order.executed == asyn["steps"] > 0
    assert async_order.overlapped == async_order.executed, "a step ended before the next plan was made"
