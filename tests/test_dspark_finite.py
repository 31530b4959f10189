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
