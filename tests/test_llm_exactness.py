"""The engine's exactness guarantee holds through the public API: LLM.generate with a small token budget
(chunked prefill mixed with decodes) and a small cache (preemption) returns each request's solo greedy output."""

import pytest

from deepinfer import LLM
from test_engine_exactness import model_dir, small_budget, solo_outputs, workload  # noqa: F401  (pytest fixtures)


@pytest.mark.parametrize("zero_overhead", [False, True], ids=["sync", "async"])
def test_llm_generate_equals_each_request_run_alone(workload, model_dir, solo_outputs, zero_overhead):  # noqa: F811
    with LLM(
        model=model_dir,
        engine={"process": "inproc", "zero_overhead_scheduling": zero_overhead, "max_num_batched_tokens": 48,
                "max_num_seqs": 16},
        cache={"memory_budget": small_budget(model_dir), "block_size": 16},
    ) as llm:
        outputs = llm.generate(prompt_token_ids=workload[0], sampling_params=workload[1], use_tqdm=False)
        metrics = llm.last_metrics
    assert [o.token_ids for o in outputs] == solo_outputs
    assert metrics["preemptions"] > 0 and metrics["mixed_steps"] > 0
