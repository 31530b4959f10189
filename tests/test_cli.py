"""`python -m deepinfer`: runs from any directory, reports in one line on user errors, sweeps with --multirun."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.sampling import SamplingParams
from deepinfer.kernels.registry import OP_KINDS

REPO = Path(__file__).resolve().parents[1]
FAST = ["runtime.num_threads=1", "sampling.max_tokens=4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e["DEEPINFER_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    e.pop("DEEPINFER_BATCH_INVARIANT", None)
    return e


def deepinfer(args, cwd, env, python_path=None):
    if python_path:
        env = {**env, "PYTHONPATH": python_path}
    return subprocess.run(
        [sys.executable, "-m", "deepinfer", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def assert_one_line_error(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_runs_the_embedded_model_from_another_directory_and_writes_outputs(tmp_path, env):
    proc = deepinfer([*FAST, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "[0] 'def fibonacci(n):' -> " in proc.stdout
    for label in ("model", "hardware", "stages", "backends", "tokens", "speed"):
        assert f"\n{label:<10}" in proc.stdout
    assert "\nprefix cache " in proc.stdout and "prompt tokens cached" in proc.stdout  # on by default on the CPU
    assert "tokens/s" in proc.stdout and f"torch: all {len(OP_KINDS)} op kinds" in proc.stdout
    lines = (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(len(json.loads(line)["token_ids"]) == 4 for line in lines)


def test_prompts_from_a_jsonl_file(tmp_path, env):
    (tmp_path / "in.jsonl").write_text('{"prompt": "import os"}\n\n{"prompt_token_ids": [0, 40, 41]}\n')
    proc = deepinfer([*FAST, "input_path=in.jsonl", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "r" / "outputs.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["import os", None]
    assert rows[1]["prompt_token_ids"] == [0, 40, 41]


def test_multirun_writes_one_result_per_job_and_a_sweep_table(tmp_path, env):
    sweep = tmp_path / "sweep"
    args = ["--multirun", "sampling.temperature=0,0.7", "runtime.seed=7", 'prompts=["def f("]']
    proc = deepinfer([*args, *FAST, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in sweep.glob("*/outputs.jsonl")) == ["outputs.jsonl"] * 2
    assert (sweep / "0" / "outputs.jsonl").exists() and (sweep / "1" / "outputs.jsonl").exists()
    table = (sweep / "sweep_summary.md").read_text()
    assert "sampling.temperature=0 " in table and "sampling.temperature=0.7 " in table
    assert "sweep summary (2 jobs" in proc.stdout


@pytest.mark.parametrize(
    "args,expected",
    [
        (["+recipe=flash_sm100"], "recipe flash_sm100 needs an NVIDIA SM100 GPU"),
        (["foo=1"], "foo=1: unknown config key 'foo'"),
        (["sampling.top_p=2"], "sampling.top_p=2.0 is out of range; allowed: (0, 1]"),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(tmp_path, env, args, expected):
    line = assert_one_line_error(deepinfer(args, cwd=tmp_path, env=env))
    assert expected in line
    if args == ["+recipe=flash_sm100"]:
        assert "found: " in line and "+recipe=tiny_cpu" in line


def test_a_bad_job_in_a_sweep_fails_before_any_job_runs(tmp_path, env):
    proc = deepinfer(["--multirun", "sampling.top_p=0.5,3", f"hydra.sweep.dir={tmp_path / 's'}"], cwd=tmp_path, env=env)
    assert "sampling.top_p=3.0 is out of range" in assert_one_line_error(proc)
    assert not (tmp_path / "s").exists()


def test_cfg_job_shows_env_values_applied(tmp_path, env):
    proc = deepinfer(["--cfg", "job"], cwd=tmp_path, env={**env, "DEEPINFER_BATCH_INVARIANT": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "batch_invariant: true" in proc.stdout


@pytest.mark.parametrize("recipe", ["flash_sm90", "flash_sm100", "flash_ascend950"])
def test_cfg_job_prints_a_recipe_without_its_hardware(recipe, tmp_path, env):
    """Printing a config needs no hardware (it is checked when a run starts: the recipe's run fails on this CPU)."""
    proc = deepinfer([f"+recipe={recipe}", "--cfg", "job"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"recipe: {recipe}" in proc.stdout and "max_num_batched_tokens: 8192" in proc.stdout
    assert "name: v41_flash" in proc.stdout and not (tmp_path / "outputs").exists()


def test_cli_and_api_give_the_same_tokens_for_the_same_config(tmp_path, env, monkeypatch):
    prompts = ["def add(a, b):", "import sys"]
    overrides = ["runtime.num_threads=1", "sampling.max_tokens=6", "sampling.temperature=0.8", "runtime.seed=11"]
    proc = deepinfer([*overrides, f"prompts={json.dumps(prompts)}", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    cli = [json.loads(x)["token_ids"] for x in (tmp_path / "r" / "outputs.jsonl").read_text().splitlines()]
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", env["DEEPINFER_CACHE_DIR"])
    with LLM(overrides=overrides) as llm:
        api = [o.token_ids for o in llm.generate(prompts, use_tqdm=False)]
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert api == cli and len(cli[0]) == 6
    assert [o.token_ids for o in greedy] != cli  # the sampled run really sampled


def test_runs_after_a_non_editable_install(tmp_path, env):
    pytest.importorskip("setuptools")  # the build backend, used without build isolation (no network needed)
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns(
        "tests", ".git", ".devpack", "benchmarks", "build", "*.egg-info", "__pycache__", "outputs", "multirun"
    )
    shutil.copytree(REPO, src, ignore=ignore)
    target = tmp_path / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert pip.returncode == 0, pip.stderr
    assert (target / "deepinfer" / "conf" / "hardware" / "sm90.yaml").is_file()
    assert (target / "deepinfer" / "recipes" / "tiny_cpu.yaml").is_file()
    run = tmp_path / "elsewhere"
    run.mkdir()
    # Run the CLI in a process that then lists every deepinfer module it imported: all must come from the
    # installed copy (an editable install elsewhere on sys.path would otherwise hide a file missing from it).
    probe = (
        "import sys\n"
        "from deepinfer.__main__ import main\n"
        f"rc = main(sys.argv[1:])\n"
        f"foreign = [m for m, mod in sys.modules.items() if m.startswith('deepinfer') and "
        f"getattr(mod, '__file__', None) and not mod.__file__.startswith({str(target)!r})]\n"
        "print('FOREIGN', foreign)\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, "+recipe=tiny_cpu", *FAST, f"hydra.run.dir={run / 'r'}"],
        cwd=run, env={**env, "PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "FOREIGN []" in proc.stdout, proc.stdout
    assert len((run / "r" / "outputs.jsonl").read_text().splitlines()) == 4
