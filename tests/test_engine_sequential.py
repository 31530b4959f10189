"""The engine built from the composed configuration (what LLM will use) gives, request for request, what the
one-request-at-a-time sequential runner gives: same seeds, penalties, stop strings, text and finish reasons."""

from __future__ import annotations

from pathlib import Path

from deepinfer.api import LLM
from deepinfer.frontend import LLMEngine
from deepinfer.pipeline import load_program
from deepinfer.sampling import SamplingParams
from sequential_oracle import SequentialRunner  # tests/ is on pytest's pythonpath (pyproject)

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")


def test_the_engine_from_settings_matches_the_sequential_runner_with_sampling():
    with LLM(model=MODEL, hardware="cpu", seed=7, process="inproc") as llm:
        s = llm.settings
        oracle, _ = load_program(s)  # the frontend holds no weights: the oracle loads the model from the same settings
        sequential = SequentialRunner(oracle, s.engine.max_model_len, s.runtime.seed)
        prompts = [[0] + [3 + (31 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(8)]
        params = [
            SamplingParams(
                temperature=0.9,
                top_p=0.9,
                max_tokens=10,
                ignore_eos=i % 2 == 0,
                presence_penalty=0.5 if i == 3 else 0.0,
                stop=["e"] if i in (5, 7) else None,
                top_logprobs=2 if i == 1 else 0,
            )
            for i in range(8)
        ]
        want = [sequential.run(i, None, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        with LLMEngine.for_settings(s, llm.program.tokenize.tokenizer, process="subprocess",
                                    max_num_batched_tokens=16) as engine:
            got = engine.generate(prompts, params, use_tqdm=False)
    assert any(w.finish_reason == "stop" for w in want), "a stop string fires in this workload"
    for w, g in zip(want, got):
        assert (g.request_id, g.token_ids, g.text, g.finish_reason) == (w.request_id, w.token_ids, w.text, w.finish_reason)
        assert [lp.top_logprobs and [t for t, _ in lp.top_logprobs] for lp in g.logprobs] == [
            lp.top_logprobs and [t for t, _ in lp.top_logprobs] for lp in w.logprobs
        ]
