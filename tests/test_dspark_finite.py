"""tools/dspark_finite.py, the DSpark non-finite diagnosis, end to end on the embedded model on the CPU: it serves
DSpark verification steps and finds every one finite there (exit 0); a poisoned step is reported (exit 1)."""

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import dspark_finite  # noqa: E402


def test_the_tiny_model_verifies_with_finite_logits_and_the_tool_says_so(capsys):
    assert dspark_finite.main(["--model", "tiny", "--context", "64", "--tokens", "8", "--batch", "2",
                               "--graphs", "off"]) == 0
    served = re.search(r": 0 of (\d+) verifications non-finite; 0 requests", capsys.readouterr().out)
    assert served and int(served.group(1)) > 0


def test_a_verification_with_nan_logits_is_reported(monkeypatch, capsys):
    from deepinfer.engine.model_runner import ModelRunner

    inner = ModelRunner._verify

    def poisoned(self, verify, sampled, grammars, sample_rows, row_errors, seq_rows, drafts_of, logits, *rest):
        nan = torch.full_like(logits, float("nan"))  # the model's output for this verification step
        return inner(self, verify, sampled, grammars, sample_rows, row_errors, seq_rows, drafts_of, nan, *rest)

    monkeypatch.setattr(ModelRunner, "_verify", poisoned)
    assert dspark_finite.main(["--model", "tiny", "--context", "64", "--tokens", "4", "--batch", "2",
                               "--graphs", "off"]) == 1
    assert "non-finite" in capsys.readouterr().out


def test_the_trace_names_the_first_op_that_made_a_nan(monkeypatch, capsys):
    real_build = dspark_finite.build

    def build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        inner, calls = model.ops._fns["mhc_expand"], [0]

        def expand(*a, **k):  # from the 40th call on (the prefill's are the first), a NaN in one row
            out = inner(*a, **k)
            calls[0] += 1
            if calls[0] >= 40:
                out = out.clone()
                out[0] = float("nan")
            return out

        model.ops._fns["mhc_expand"] = expand
        return model

    monkeypatch.setattr(dspark_finite, "build", build)
    assert dspark_finite.main(["--model", "tiny", "--context", "64", "--tokens", "4", "--batch", "2",
                               "--graphs", "off", "--trace"]) == 1
    first = [line for line in capsys.readouterr().out.splitlines() if "first NaN from NaN-free inputs" in line]
    assert first and "'op': 'mhc_expand'" in first[0]


def test_the_trace_refuses_cuda_graphs():
    import pytest

    with pytest.raises(SystemExit) as exc:
        dspark_finite.main(["--model", "tiny", "--graphs", "on", "--trace"])
    assert exc.value.code == 2
