"""The test oracle the engine is compared with (tests/test_engine_sequential.py): one request at a time through the
StepProgram.

Per request: validate the prompt (tokenize stage), prefill it into a fresh sequence state, then sample and decode
one token per step until a stop condition (deepinfer.sampling.StopChecker: EOS unless ignore_eos,
stop_token_ids, stop strings, max_tokens capped by the model's length limit). Exact: each token comes from the same
cached forward the engine will run, with nothing shared between requests.
"""

from __future__ import annotations

import dataclasses
import time

from deepinfer.models import ForwardBatch
from deepinfer.outputs import RequestMetrics, RequestOutput, TokenLogprob, error_output
from deepinfer.pipeline.program import StepProgram
from deepinfer.sampling import SampleRow, SamplingParams, StopChecker, prompt_logprobs, seed_for


class SequentialRunner:
    def __init__(self, program: StepProgram, max_model_len: int, base_seed: int | None = None):
        self.program = program
        self.max_model_len = max_model_len
        self.base_seed = base_seed  # runtime.seed

    def run(self, request_id: int, prompt: str | None, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        """One request, start to finish. User errors come back as finish_reason="error", never as exceptions."""
        reason = self.program.tokenize.validate(prompt_ids, self.max_model_len)
        if reason is None and params.n != 1:
            reason = f"SamplingParams.n={params.n} is not supported by the sequential runner; allowed: 1"
        if reason is None and params.so_args is not None:
            reason = "structured outputs (so_args) need the engine; the sequential runner has no grammar backend"
        if reason is not None:
            return error_output(request_id, prompt, prompt_ids, reason)
        return self._generate(request_id, prompt, list(prompt_ids), params)

    def _generate(self, request_id, prompt, prompt_ids, params) -> RequestOutput:
        p = self.program
        metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids))
        state = p.new_state()
        logits = p.prefill(ForwardBatch([prompt_ids], [state], all_logits=params.prompt_logprobs))
        prompt_lps = None
        if params.prompt_logprobs:
            prompt_lps = [
                None if s is None else TokenLogprob(s.token_id, s.logprob, s.top_logprobs)
                for s in prompt_logprobs(logits, prompt_ids, params.top_logprobs, p.sample.vocab_size)
            ]
            logits = logits[-1:]
        seed = seed_for(params.seq_seed, self.base_seed, request_id)
        # The context limit is a max_tokens cap, so the stop checker ends the request (and flushes its text).
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        stop = StopChecker(params, p.tokenize.tokenizer, p.sample.eos_token_id)
        logprobs: list[TokenLogprob] = []
        finish, error = None, None
        while finish is None:
            row = SampleRow(params, seed, len(stop.token_ids), stop.token_ids, prompt_ids)
            out = p.sample.sample(logits, [row])[0]
            if out.error is not None:
                finish, error = "error", out.error
                break
            if metrics.first_token_time is None:
                metrics.first_token_time = time.perf_counter()
            logprobs.append(TokenLogprob(out.token_id, out.logprob, out.top_logprobs))
            finish = stop.append(out.token_id)
            if finish is None:
                logits = p.decode(ForwardBatch([[out.token_id]], [state]))
        metrics.finish_time = time.perf_counter()
        metrics.num_output_tokens = len(stop.token_ids)
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            text=stop.text,
            token_ids=list(stop.token_ids),
            finish_reason=finish,
            error=error,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            metrics=metrics,
        )
