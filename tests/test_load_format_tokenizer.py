"""model.load_format (auto | dummy: DeepInfer's random weights for benchmarking) and model.tokenizer (another
tokenizer.json than the checkpoint's), through the loader, the config, the CLI and the DeepInfer drop-in."""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from deepinfer import embedded
from deepinfer.config.errors import ConfigError
from deepinfer.kernels.packed_experts import QuantizedWeight
from deepinfer.models import load_model
from deepinfer.models.loading import CheckpointError, expected_tensors, load_checkpoint
from deepinfer.models.synthetic import random_weights

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny():
    return embedded.materialize("tiny-random")


@pytest.fixture(scope="module")
def bare(tiny, tmp_path_factory):
    """A checkpoint directory with only config.json and tokenizer.json: no weight file."""
    d = tmp_path_factory.mktemp("bare")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny / name, d / name)
    return d


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# ---- load_format=dummy ---------------------------------------------------------------------------------------
def test_dummy_weights_are_the_released_formats_for_the_checkpoints_own_config(tiny, bare):
    real = load_checkpoint(tiny, quantized_experts=True, draft_layers=True)
    cfg = load_checkpoint(bare, load_format="dummy").config
    assert cfg == real.config
    dummy = random_weights(cfg, "cpu", torch.float32, seed=0, packed_experts=True, fp8_linears=False)
    optional = {k for k, spec in expected_tensors(cfg).items() if spec.optional}  # image-token router biases
    assert set(dummy) == set(real.weights) - optional  # every tensor the text model uses, draft layers included
    assert any(k.startswith("mtp.") for k in dummy)
    for name, w in real.weights.items():
        if name in optional:
            continue
        d = dummy[name]
        if isinstance(w, QuantizedWeight):  # routed experts FP4, shared experts FP8: kept as stored
            assert isinstance(d, QuantizedWeight) and (d.fmt, d.shape) == (w.fmt, w.shape), name
        else:
            assert d.shape == w.shape and d.dtype == w.dtype, name


def test_same_config_and_seed_give_the_same_dummy_weights_another_seed_others(bare):
    def weights(seed):
        return random_weights(load_checkpoint(bare, load_format="dummy").config, "cpu", torch.float32, seed=seed,
                              packed_experts=False, fp8_linears=False)

    a, b, c = weights(3), weights(3), weights(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    # dense experts are the stored FP4 draws dequantised: the values do not depend on packed_experts
    packed = random_weights(load_checkpoint(bare, load_format="dummy").config, "cpu", torch.float32, seed=3,
                            packed_experts=True, fp8_linears=False)
    name = next(k for k, v in packed.items() if isinstance(v, QuantizedWeight) and v.fmt == "fp4")
    assert torch.equal(packed[name].dense(torch.float32), a[name])


def test_load_model_dummy_reads_no_weight_file_and_says_the_weights_are_random(bare, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.loading"):
        one = load_model(bare, load_format="dummy", seed=5)
    assert one.drafter is not None  # the config's draft layers, random too
    lines = [r.getMessage() for r in caplog.records if "RANDOM" in r.getMessage()]
    assert len(lines) == 1 and "seed 5" in lines[0] and "\n" not in lines[0]
    two = load_model(bare, load_format="dummy", seed=5)
    assert torch.equal(one.embed, two.embed)
    with pytest.raises(CheckpointError) as info:  # auto needs the weights
        load_model(bare)
    assert "safetensors" in _one_line(info).lower()
    with pytest.raises(CheckpointError) as info:
        load_model(bare, load_format="random")
    assert _one_line(info) == "model.load_format='random' is not supported; allowed: auto, dummy, dummy_shared"


def test_a_hub_id_with_dummy_downloads_only_config_and_tokenizer(monkeypatch, bare):
    import huggingface_hub

    from deepinfer.models.loading import resolve_model_dir

    asked = []

    def fake_snapshot_download(repo_id, allow_patterns, local_files_only):
        asked.append(list(allow_patterns))
        return str(bare)

    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir("someone/model", weights=False) == bare
    assert not any("safetensors" in p for p in asked[0]) and "config.json" in asked[0]
    resolve_model_dir("someone/model")
    assert "*.safetensors" in asked[1]


def test_dropin_dummy_on_a_directory_without_weights_generates(bare):
    from deepinfer.entrypoints.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    with LLM(model=str(bare), load_format="DUMMY", seed=7, process="inproc", runtime={"num_threads": 1}) as llm:
        assert llm._llm.settings.model.load_format == "dummy"
        outs = llm.generate(["def f(", "import os"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        assert len(outs) == 2 and all(isinstance(t, str) and t for t in outs)
        llm.decode_sequence = False
        again = llm.generate(["def f("], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)
        assert len(again[0]) == 6 and again[0][-1].finished  # DeepInfer's per-token outputs


def test_the_config_key_is_checked_and_the_cli_takes_it(bare, tmp_path):
    from deepinfer.api import load_settings, overrides_for

    assert overrides_for(None, load_format="dummy", tokenizer="t.json") == [
        "model.load_format='dummy'", "model.tokenizer='t.json'"]  # deepinfer.LLM's shortcuts
    with pytest.raises(ConfigError) as info:
        load_settings(["model.load_format=random"])
    assert _one_line(info) == "model.load_format='random' is not allowed; allowed: auto, dummy, dummy_shared"
    with pytest.raises(ConfigError) as info:
        from deepinfer.entrypoints.llm import LLM

        LLM(model=str(bare), load_format="safetensors")
    assert _one_line(info).startswith("LLM(load_format='safetensors') is not supported; allowed: 'auto', 'dummy'")

    env = {**os.environ, "DEEPINFER_CACHE_DIR": os.environ.get("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))}
    proc = subprocess.run([sys.executable, "-m", "deepinfer", f"model.path={bare}", "model.load_format=dummy",
                           "runtime.num_threads=1", "sampling.max_tokens=3", "sampling.ignore_eos=true",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "weights are RANDOM" in proc.stderr + proc.stdout
    lines = (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()
    assert lines and all(len(json.loads(line)["token_ids"]) == 3 for line in lines)


# ---- tokenizer= ----------------------------------------------------------------------------------------------
def test_a_copy_of_the_tokenizer_elsewhere_gives_the_same_output(tiny, tmp_path):
    from deepinfer.entrypoints.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    other = tmp_path / "tok"
    other.mkdir()
    shutil.copy(tiny / "tokenizer.json", other / "tokenizer.json")
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    texts = []
    for tok in (None, other, other / "tokenizer.json"):  # the checkpoint's, a directory, a file
        with LLM(model=str(tiny), tokenizer=None if tok is None else str(tok), process="inproc",
                 runtime={"num_threads": 1}) as llm:
            assert llm._llm.settings.model.tokenizer == (None if tok is None else str(tok))
            texts.append(llm.generate(["def fibonacci(n):"], sp, use_tqdm=False))
    assert texts[0] == texts[1] == texts[2]


def test_a_tokenizer_whose_vocabulary_does_not_fit_is_one_line_naming_both_sizes(tiny, tmp_path):
    from deepinfer.entrypoints.llm import LLM

    bigger = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    bigger.add_tokens(["<extra_a>", "<extra_b>"])
    bigger.save(str(tmp_path / "bigger.json"))
    with pytest.raises(CheckpointError) as info:
        LLM(model=str(tiny), tokenizer=str(tmp_path / "bigger.json"))
    text = _one_line(info)
    assert text.startswith("model.tokenizer=") and "530 tokens" in text and "vocab_size is 528" in text

    # fits the embedding but not the Engram tables (their normalised vocabulary)
    small = Tokenizer(WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    small.save(str(tmp_path / "small.json"))
    with pytest.raises(CheckpointError) as info:
        load_model(tiny, tokenizer=tmp_path / "small.json", weights=False)
    text = _one_line(info)
    assert "100 entries" in text and "engram_compressed_vocab_size=422" in text

    with pytest.raises(CheckpointError) as info:
        LLM(model=str(tiny), tokenizer=str(tmp_path / "nowhere"))
    assert _one_line(info).startswith(f"model.tokenizer='{tmp_path / 'nowhere'}': ") and "allowed: null" in str(info.value)
