"""The CPU image example of README (issue 27, item 7): tools/vision_fixture_model.py assembles a text+vision checkpoint
from the golden fixtures alone (a text fixture's model, tiny-vit2's image path), and README's snippet generates with
an image on it. The embedded default stays text-only and says so when given an image."""

from __future__ import annotations

import json
import re
import shlex
import sys
from functools import partial
from pathlib import Path

import pytest
from safetensors.torch import load_file

from deepinfer import LLM, SamplingParams
from deepinfer import embedded
from test_docs import README, split_blocks
from vision_fixture import VISION_FIXTURE, case, png

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import vision_fixture_model as tool  # noqa: E402

INPROC = {"process": "inproc", "runtime": {"num_threads": 1}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def readme_example() -> tuple[list[str], str]:
    """(argv of README's `python tools/vision_fixture_model.py ...` line, the Python block right after it)."""
    _, blocks = split_blocks(README.read_text())
    for i, (info, _, body) in enumerate(blocks):
        if info == "bash" and any("tools/vision_fixture_model.py" in line for line in body):
            line = next(line for line in body if "tools/vision_fixture_model.py" in line)
            info2, _, code = blocks[i + 1]
            assert info2 == "python" and len(body) + len(code) <= 6  # the "short CPU example"
            return shlex.split(line, comments=True), "\n".join(code)
    raise AssertionError("README has no tools/vision_fixture_model.py example")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tool.write(tmp_path_factory.mktemp("fixture-vision") / "m")


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), **INPROC) as llm:
        yield llm


def prompt(n: int) -> list[int]:
    return case(n, "prompt_ids").tolist()  # BOS + text[0] + 511 + text[1], the fixture tokenizer's ids


def generate(llm, prompts, mm):
    return llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, multi_modal_data=mm, use_tqdm=False)


@pytest.mark.parametrize("text", tool.TEXTS)
def test_the_checkpoint_is_the_two_fixtures_unchanged(tmp_path, text):
    out = tool.write(tmp_path / "m", text)
    src = tool.FIXTURES / "deepseek_v41" / text
    got = load_file(str(out / "model.safetensors"))
    want = {**load_file(str(src / "model.safetensors")), **load_file(str(VISION_FIXTURE / "model.safetensors"))}
    assert got.keys() == want.keys() and all(got[k].dtype == want[k].dtype and got[k].equal(want[k]) for k in want)
    cfg, text_cfg = (json.loads(p.read_text()) for p in (out / "config.json", src / "config.json"))
    vision_cfg = json.loads((VISION_FIXTURE / "config.json").read_text())
    assert cfg == {**text_cfg, "image_token_id": 511, "vision_config": vision_cfg["vision_config"]}
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_non_empty_directory_or_an_unknown_text_fixture_is_refused(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(SystemExit, match=r"is not empty; allowed: a new or empty directory$"):
        tool.write(tmp_path)
    with pytest.raises(SystemExit, match=r"^--text 'tiny'; allowed: tiny-swa-csa2, "):
        tool.write(tmp_path / "new", "tiny")


def test_readme_example_generates_with_an_image(tmp_path, llm):
    argv, code = readme_example()
    assert argv[:2] == ["python", "tools/vision_fixture_model.py"]
    out_dir = tmp_path / "tiny-vision"
    tool.main([str(out_dir), *argv[3:]])
    code = code.replace(argv[2], str(out_dir)).replace('open("tests/', f'open("{tool.FIXTURES.parent}/')
    env = {"LLM": partial(LLM, **INPROC), "SamplingParams": SamplingParams}
    exec(compile(code, "README.md", "exec"), env)
    out = env["out"]
    assert out.error is None and len(out.token_ids) == 8
    assert out.prompt_token_ids == case(0, "input_ids").tolist()  # the fixture's expanded layout
    # the same request on another load of the same fixtures: the same greedy tokens
    assert generate(llm, [prompt(0)], {"image_bytes": [png(0)]})[0].token_ids == out.token_ids


def test_greedy_tokens_are_deterministic_and_the_image_changes_them(llm):
    outs = generate(llm, [prompt(0), prompt(2), prompt(0), [0, 38, 444, 69]],
                    [{"image_bytes": [png(0)]}, {"image_bytes": [png(2)]}, {"image_bytes": [png(0)]}, None])
    assert all(o.error is None for o in outs)
    assert outs[0].token_ids == outs[2].token_ids  # the same image twice, in one batch
    assert outs[0].token_ids != outs[1].token_ids  # a different image
    assert outs[1].prompt_token_ids == case(2, "input_ids").tolist()
    alone = generate(llm, [prompt(0)], {"image_bytes": [png(0)]})[0]
    assert alone.token_ids == outs[0].token_ids  # batched with others or alone


def test_the_embedded_default_is_text_only_and_says_so_when_given_an_image():
    default = embedded.materialize()
    assert "vision_config" not in json.loads((default / "config.json").read_text())
    assert not any(re.match(r"(vision|aligner)\.|image_", k) for k in load_file(str(default / "model.safetensors")))
    with LLM(**INPROC) as llm:
        assert llm.settings.model.path == str(default)  # LLM() is embedded:tiny
        out = llm.generate("Describe <｜image｜>", GREEDY, multi_modal_data={"image_bytes": [png(0)]},
                           use_tqdm=False)[0]
    assert out.finish_reason == "error" and out.token_ids == []
    assert out.error == ("multi_modal_data: this model has no vision tower (no vision_config, or no vision.* / "
                         "aligner.* tensors in its checkpoint); allowed: text-only prompts")
