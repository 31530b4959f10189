"""EleutherAI's lm-eval against the server on the embedded model over loopback, as its users run it
(`lm_eval --model local-completions`): a loglikelihood multiple-choice task (echo + prompt logprobs) and a
generate_until task, both at --batch_size 8 (a list of 8 prompts per request), from a tiny dataset the test writes.

lm-eval is in the `eval` extra (`pip install -e ".[test,eval]"`; its API models need the `[api]` packages), not in
`test`: the test is skipped where it is not installed. Marked slow: lm-eval's import and task loading alone take
tens of seconds. Run 2026-12-02 with lm-eval 0.4.13: passed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serving_helpers import MODEL

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (pip install -e '.[eval]')")

QUESTIONS = [(f"Q: {a} + {b} =", [str(a + b), str(a + b + 1), str(a + b + 2), str(a * b + 7)], 0)
             for a, b in [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9)]]

MC_TASK = """task: deepinfer_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: deepinfer_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture()
def tasks(tmp_path, server):
    """The two task files, their dataset and the served tokenizer saved as a Hugging Face tokenizer directory
    (lm-eval counts tokens with it)."""
    from deepinfer.entrypoints.hf_tokenizer import hf_tokenizer

    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "tiny_mc.yaml").write_text(MC_TASK.format(data=data))
    (tmp_path / "tiny_gen.yaml").write_text(GEN_TASK.format(data=data))
    tok = tmp_path / "tokenizer"
    hf_tokenizer(server.state.converter.tokenizer, server.engine.info.eos_token_id).save_pretrained(tok)
    return tmp_path, tok


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lm_eval_runs_a_loglikelihood_and_a_generate_until_task_at_batch_size_8(server, tasks):
    folder, tokenizer = tasks
    args = (f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={tokenizer},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
    out = folder / "results"
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--tasks", "deepinfer_tiny_mc,deepinfer_tiny_gen", "--include_path", str(folder),
                           "--batch_size", "8", "--output_path", str(out)],
                          capture_output=True, text=True, cwd=folder, timeout=580)
    assert done.returncode == 0, done.stderr[-3000:]
    [result_file] = list(out.rglob("results*.json"))
    results = json.loads(result_file.read_text())
    mc, gen = results["results"]["deepinfer_tiny_mc"], results["results"]["deepinfer_tiny_gen"]
    assert 0.0 <= mc["acc,none"] <= 1.0 and 0.0 <= gen["exact_match,none"] <= 1.0
    assert results["n-samples"]["deepinfer_tiny_mc"]["effective"] == len(QUESTIONS)
    assert results["n-samples"]["deepinfer_tiny_gen"]["effective"] == len(QUESTIONS)
