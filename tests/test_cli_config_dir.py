"""An ops team's own recipe folder: `--config-dir DIR` or `hydra.searchpath=[file://DIR]` with DIR/recipe/NAME.yaml,
selected with `+recipe=NAME` like a shipped recipe (docs/config.md: "Your own recipes")."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from deepinfer.api import load_settings

MY_SITE = """\
# @package _global_
defaults:
  - override /hardware: cpu
  - override /model: tiny

recipe: my_site
engine:
  max_num_seqs: 3
  max_num_batched_tokens: 512
sampling:
  temperature: 0.5
  max_tokens: 2
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e.setdefault("DEEPINFER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return e


@pytest.fixture
def site(tmp_path):
    """tmp_path/myrecipes/recipe/my_site.yaml (and a broken one); returns the folder given to --config-dir."""
    folder = tmp_path / "myrecipes"
    (folder / "recipe").mkdir(parents=True)
    (folder / "recipe" / "my_site.yaml").write_text(MY_SITE)
    (folder / "recipe" / "bad_site.yaml").write_text("# @package _global_\nrecipe: bad_site\nengine:\n  max_num_seqs: 0\n")
    return folder


def deepinfer(args, cwd, env):
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def shown_job_config(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("how", ["config-dir", "searchpath"])
def test_cfg_job_shows_the_recipe_of_an_own_folder(how, site, tmp_path, env):
    where = ["--config-dir", str(site)] if how == "config-dir" else [f"hydra.searchpath=[file://{site}]"]
    cfg = shown_job_config(deepinfer([*where, "+recipe=my_site", "--cfg", "job"], tmp_path, env))
    assert cfg["recipe"] == "my_site"
    assert (cfg["engine"]["max_num_seqs"], cfg["engine"]["max_num_batched_tokens"]) == (3, 512)
    assert (cfg["sampling"]["temperature"], cfg["sampling"]["max_tokens"]) == (0.5, 2)
    assert cfg["cache"]["block_size"] == 64  # the rest: the schema's defaults and cfg["model"]["path"] == "embedded:tiny"


def test_a_relative_config_dir_and_a_cli_override_over_the_recipe(site, tmp_path, env):
    cfg = shown_job_config(deepinfer(["--config-dir", "myrecipes", "+recipe=my_site", "sampling.max_tokens=5",
                                      "--cfg", "job"], tmp_path, env))
    assert (cfg["sampling"]["max_tokens"], cfg["sampling"]["temperature"]) == (5, 0.5)  # CLI > recipe


def test_a_run_of_an_own_recipe_uses_its_values(site, tmp_path, env):
    run = tmp_path / "run"
    proc = deepinfer(["--config-dir", str(site), "+recipe=my_site", 'prompts=["a"]', "engine.process=inproc",
                      "runtime.num_threads=1", f"hydra.run.dir={run}"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert "recipe my_site" in proc.stdout
    (row,) = [json.loads(x) for x in (run / "outputs.jsonl").read_text().splitlines()]
    assert len(row["token_ids"]) == 2 and row["finish_reason"] == "length"  # the recipe's max_tokens (default 16)
    assert json.loads((run / "result.json").read_text())["recipe"] == "my_site"
    job = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())  # what the job ran with
    assert (job["engine"]["max_num_seqs"], job["sampling"]["temperature"]) == (3, 0.5)


def test_a_bad_value_in_an_own_recipe_is_one_line_and_exit_2(site, tmp_path, env):
    proc = deepinfer(["--config-dir", str(site), "+recipe=bad_site"], tmp_path, env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "engine.max_num_seqs=0 is out of range" in line


def test_a_sweep_over_an_own_recipe_is_checked_before_any_job_runs(site, tmp_path, env):
    sweep = tmp_path / "sweep"
    proc = deepinfer(["--multirun", "--config-dir", str(site), "+recipe=my_site", "sampling.top_p=0.5,3",
                      f"hydra.sweep.dir={sweep}"], tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "sampling.top_p=3.0 is out of range" in line
    assert not sweep.exists()


def test_the_python_api_takes_the_folder_through_hydra_searchpath(site):
    s = load_settings([f"hydra.searchpath=[file://{site}]", "+recipe=my_site"])
    assert (s.recipe, s.engine.max_num_seqs, s.sampling.max_tokens) == ("my_site", 3, 2)


def test_an_unknown_recipe_names_the_own_ones_too(site, tmp_path, env):
    proc = deepinfer(["--config-dir", str(site), "+recipe=nope"], tmp_path, env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "+recipe=nope is not an option of config group 'recipe'; allowed: " in line
    assert "my_site" in line and "tiny_cpu" in line
