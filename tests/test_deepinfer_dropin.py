"""DeepInfer's Python API as a drop-in (deepinfer.entrypoints.llm.LLM, deepinfer.sampling_params.SamplingParams)
and LLM.generate's streaming forms (on_update, generate_iter)."""

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.config.errors import ConfigError

MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")

SCRIPT = """
from deepinfer.entrypoints.llm import LLM
from deepinfer.sampling_params import SamplingParams

llm = LLM(model=MODEL, expert_parallel_size=1, gpu_memory_utilization=0.9, seed=0, max_num_seqs=4)
prompts = ["def fibonacci(n):", "import os"]
outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, top_logprobs=2))
assert isinstance(outputs, list) and len(outputs) == 2 and all(isinstance(o, str) for o in outputs), outputs
print(repr(outputs))
llm.close()
"""


def test_a_deepinfer_script_runs_unchanged_and_gets_strings(tmp_path):
    script = tmp_path / "deepinfer_script.py"
    script.write_text(f"MODEL = {MODEL!r}\n" + SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    texts = eval(done.stdout.strip().splitlines()[-1])
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)


@pytest.fixture(scope="module")
def dropin():
    from deepinfer.entrypoints.llm import LLM

    with LLM(MODEL, process="inproc", runtime={"num_threads": 1}) as llm:
        yield llm


def test_strings_are_the_decoded_tokens_and_decode_sequence_false_gives_per_token_outputs(dropin):
    from deepinfer.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=5)
    [text] = dropin.generate("def f(", sp, use_tqdm=False)
    dropin.decode_sequence = False
    try:
        [tokens] = dropin.generate(["def f("], sp, use_tqdm=False)
    finally:
        dropin.decode_sequence = True
    assert len(tokens) == 5 and [t.num_output_tokens for t in tokens] == [1, 2, 3, 4, 5]
    assert [t.finished for t in tokens] == [False] * 4 + [True] and tokens[-1].finish_reason == "length"
    assert text == dropin.get_tokenizer().decode([t.token_id for t in tokens])  # DeepInfer's own decode
    assert all(t.token_logprobs is None for t in tokens)  # DeepInfer's logprobs=False default: none reported
    prompt = dropin.get_tokenizer().encode("def f(")
    [again] = dropin.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
    assert again == text and tokens[0].prompt_len == len(prompt)


def test_a_checkpoint_without_draft_layers_decodes_plainly(dropin):
    assert dropin._llm.settings.decoding.name == "plain"


def test_deepinfer_sampling_params_keep_its_order_defaults_and_max_tokens_zero():
    from deepinfer.sampling import SamplingParams as Ours
    from deepinfer.sampling_params import SamplingParams

    p = SamplingParams(0.5, 0.9, 5, True, 0)  # temperature, top_p, top_k, ignore_eos, max_tokens
    assert (p.temperature, p.top_p, p.top_k, p.ignore_eos, p.max_tokens) == (0.5, 0.9, 5, True, 1)
    assert isinstance(p, Ours) and p.logprobs is False and p.eos_id is None and p.seq_seed is None
    assert SamplingParams(stop=["x"], min_p=0.1).stop == ["x"]  # our other fields, by keyword
    with pytest.raises(ValueError, match="SamplingParams.top_p=2"):
        SamplingParams(top_p=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"trust_remote_code": True}, "LLM(trust_remote_code=True): this engine runs no code from a checkpoint"),
    ({"expert_parallel_size": 0}, "LLM(expert_parallel_size=0) is not allowed; allowed: an integer >= 1"),
    ({"expert_parallel_size": 3, "data_parallel_size": 2}, "parallel.expert_parallel_size=3 does not divide"),
    # cp2 runs (tests/test_context_parallel_engine.py), but like every multi-rank layout not in-process
    ({"context_parallel_size": 2}, "engine.process='inproc' with parallel=ep1_dp0_cp2 (2 ranks)"),
    ({"expert_parallel_size": 2}, "engine.process='inproc' with parallel=dep2 (2 ranks)"),  # dep2: tests/test_parallel_engine.py
    ({"load_format": "npcache"}, "LLM(load_format='npcache') is not supported; allowed: 'auto', 'dummy'"),
    ({"revision": "main"}, "LLM(revision='main'): pinned hub revisions are not available yet"),
    ({"gpu_memory_utilization": 1.5}, "cache.memory_fraction=1.5 is out of range"),
    ({"chunked_prefill": False, "max_num_batched_tokens": 64}, "engine.max_num_batched_tokens=64 is out of range"),
    ({"frobnicate": 1}, "LLM(frobnicate=1): unknown argument 'frobnicate'"),
])
def test_arguments_that_cannot_apply_are_refused_with_one_line(kwargs, message):
    from deepinfer.entrypoints.llm import LLM

    with pytest.raises(ConfigError) as info:
        LLM(MODEL, process="inproc", **kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_images_are_refused_with_one_line_on_a_text_only_model(dropin):
    """The tiny text checkpoint's vision_config is null: multi_modal_data is a one-line ConfigError, nothing runs."""
    images = {"image_bytes": [b"\x89PNG"], "image_sizes": [[1, 1]]}
    with pytest.raises(ConfigError, match=r"^generate\(multi_modal_data=...\): this model has no vision tower "
                                          r"\(no vision_config in its config.json\); allowed: None$"):
        dropin.generate("Describe <image>", multi_modal_data=images, use_tqdm=False)


def test_dropin_arguments_reach_the_config(dropin):
    s = dropin._llm.settings
    assert (s.engine.max_num_seqs, s.cache.memory_fraction, s.runtime.seed, s.engine.chunked_prefill) == (256, 0.9, 0, False)
    assert (s.model.load_format, s.model.tokenizer) == ("auto", None)  # load_format="dummy", tokenizer=PATH:
    # tests/test_load_format_tokenizer.py
    assert s.engine.max_num_batched_tokens >= s.engine.max_model_len  # chunked_prefill=False's requirement held


def test_generate_streams_through_on_update_and_the_iterator(dropin):
    from deepinfer.sampling import SamplingParams

    llm = dropin._llm
    sps = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=6)]
    seen: dict[int, list[int]] = {0: [], 1: []}
    outs = llm.generate(["def f(", "import os"], sps, use_tqdm=False,
                        on_update=lambda i, ids: seen[i].extend(ids))
    assert [seen[0], seen[1]] == [outs[0].token_ids, outs[1].token_ids]

    streamed: dict[int, list[int]] = {0: [], 1: []}
    finals = {}
    for upd in llm.generate_iter(["def f(", "import os"], sps):
        if upd.output is None:
            streamed[upd.index] += upd.token_ids
        else:
            finals[upd.index] = upd.output
    assert [streamed[0], streamed[1]] == [outs[0].token_ids, outs[1].token_ids]
    assert [finals[0].token_ids, finals[1].token_ids] == [outs[0].token_ids, outs[1].token_ids]


def test_leaving_the_iterator_early_aborts_the_rest_and_the_llm_keeps_serving(dropin):
    from deepinfer.sampling import SamplingParams

    llm = dropin._llm
    it = llm.generate_iter(["def f("], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    first = next(it)
    assert first.output is None and first.token_ids
    it.close()  # GeneratorExit: the callback raises on the next token, the engine aborts the request
    out = llm.generate(["def f("], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
