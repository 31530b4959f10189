"""DeepInfer's SamplingParams fields, implemented in the sample stage: logprobs, first_n_token_no_eos + eos_id,
golden_token_ids (forced output), max_tokens=0; and params_from_dict (JSONL lines, the engine socket)."""

from pathlib import Path

import pytest
import torch

from deepinfer.frontend import LLMEngine
from deepinfer.sampling import SampleRow, Sampler, SamplingParams
from deepinfer.sampling.params import params_from_dict
from options_helpers import settings_for

EOS = 2
MODEL = str(Path(__file__).parent / "fixtures" / "deepseek_v41" / "tiny-swa-csa2")


def row(params, position=0):
    return SampleRow(params, 0, position, [], [])


def eos_favoured():
    return torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.5]])  # EOS (2) is the argmax, then token 3


def test_first_n_token_no_eos_suppresses_the_models_eos_for_the_first_n_tokens_only():
    s = Sampler(5, EOS)
    p = SamplingParams(temperature=0, first_n_token_no_eos=2)
    assert [s.sample(eos_favoured(), [row(p, pos)])[0].token_id for pos in (0, 1, 2)] == [3, 3, EOS]
    assert s.sample(eos_favoured(), [row(SamplingParams(temperature=0))])[0].token_id == EOS


def test_eos_id_names_the_token_that_first_n_token_no_eos_suppresses():
    s = Sampler(5, EOS)
    p = SamplingParams(temperature=0, first_n_token_no_eos=1, eos_id=3)
    x = torch.tensor([[0.0, 1.0, 2.0, 5.0, 0.5]])  # token 3 favoured
    assert s.sample(x, [row(p)])[0].token_id == EOS  # 3 is banned, EOS (2) is next
    assert s.sample(x, [row(p, 1)])[0].token_id == 3


def test_golden_token_ids_force_the_output_then_sampling_continues_and_report_the_forced_tokens_logprob():
    s = Sampler(5, EOS)
    p = SamplingParams(temperature=0, golden_token_ids=[4, 0])
    logprobs = torch.log_softmax(eos_favoured(), dim=-1)[0]
    outs = [s.sample(eos_favoured(), [row(p, pos)])[0] for pos in (0, 1, 2)]
    assert [o.token_id for o in outs] == [4, 0, EOS]
    assert outs[0].logprob == pytest.approx(logprobs[4].item())
    bad = s.sample(eos_favoured(), [row(SamplingParams(golden_token_ids=[9]))])[0]
    assert "golden_token_ids[0]=9 is out of range; allowed: a token id < 5" in bad.error


def test_logprobs_false_reports_none_unless_top_logprobs_ask():
    s = Sampler(5, EOS)
    assert s.sample(eos_favoured(), [row(SamplingParams(logprobs=False))])[0].logprob is None
    out = s.sample(eos_favoured(), [row(SamplingParams(logprobs=False, top_logprobs=2))])[0]
    assert out.logprob is not None and len(out.top_logprobs) == 2
    assert s.sample(eos_favoured(), [row(SamplingParams())])[0].logprob is not None


def test_max_tokens_zero_is_deepinfers_one_and_new_fields_are_checked():
    assert SamplingParams(max_tokens=0).max_tokens == 1
    for kwargs, text in [({"first_n_token_no_eos": -1}, "first_n_token_no_eos=-1"), ({"eos_id": "x"}, "eos_id='x'"),
                         ({"golden_token_ids": [1, -2]}, "golden_token_ids=[1, -2]"), ({"logprobs": 1}, "logprobs=1")]:
        with pytest.raises(ValueError, match=text.replace("[", r"\[").replace("]", r"\]")):
            SamplingParams(**kwargs)


def test_params_from_dict_names_an_unknown_field_and_passes_on_value_errors():
    params, error = params_from_dict({"temperature": 0, "golden_token_ids": [1]})
    assert error is None and params.golden_token_ids == [1]
    _, error = params_from_dict({"temprature": 0})
    assert error.startswith("unknown SamplingParams field 'temprature'; allowed: temperature, top_p")
    _, error = params_from_dict({"top_p": 2.0})
    assert error == "SamplingParams.top_p=2.0 is out of range; allowed: (0, 1]"


def test_the_engine_forces_golden_tokens_suppresses_eos_and_drops_logprobs_end_to_end():
    with LLMEngine.for_settings(settings_for(MODEL, process="inproc", memory_budget=1 << 22)) as eng:
        free = eng.generate([[0, 5, 6]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        golden = [free.token_ids[0] + 1, 7]
        outs = eng.generate([[0, 5, 6]] * 2, [SamplingParams(temperature=0, max_tokens=4, golden_token_ids=golden),
                                              SamplingParams(temperature=0, max_tokens=4, logprobs=False)],
                            use_tqdm=False)
    assert outs[0].token_ids[:2] == golden and len(outs[0].token_ids) == 4 and outs[0].logprobs is not None
    assert outs[1].token_ids == free.token_ids and outs[1].logprobs is None
