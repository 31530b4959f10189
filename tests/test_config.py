"""The config tree, the schema checks and the one resolve step (deepinfer/config)."""

import dataclasses
import os
from importlib import resources

from pathlib import Path

import pytest
from omegaconf import DictConfig

from deepinfer.api import load_settings, overrides_for
from deepinfer.config import hardware as hw
from deepinfer.config.compose import compose, group_options, recipe_names
from deepinfer.config.errors import ConfigError
from deepinfer.config.resolve import resolve, with_model_limits
from deepinfer.config.schema import Settings
from deepinfer.pipeline import load_program

CPU = hw.Found("cpu", "cpu", "no CUDA device and no torch_npu (CPU only)")
H200 = hw.Found("cuda", "sm90", "NVIDIA H200 (sm90)", 9, 141 * 2**30)
B200 = hw.Found("cuda", "sm100", "NVIDIA B200 (sm100)", 10, 180 * 2**30)
GROUPS = ("hardware", "parallel", "decoding", "yoco", "model", "pipeline")
THIS_MACHINE = hw.detect()


@pytest.fixture(autouse=True)
def _private_model_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "deepinfer-cache"))


def settle(overrides, found=CPU):
    return resolve(compose(overrides), found=found)


def one_line_error(overrides, found=CPU) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides, found)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- every option of every group, every recipe ---------------------------------------------------------------
GROUP_OPTIONS = [(g, o) for g in GROUPS for o in group_options(g)]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_and_resolves_where_its_hardware_exists(group, option):
    cfg = compose([f"{group}={option}"])
    assert isinstance(cfg, DictConfig)
    absent = cfg.hardware.device != "auto" and not hw.fits(
        option, cfg.hardware.device, cfg.hardware.cuda_major, THIS_MACHINE
    )
    if group == "hardware" and absent:
        assert option in one_line_error([f"{group}={option}"], THIS_MACHINE)
        return
    settings = resolve(cfg, found=THIS_MACHINE)
    assert isinstance(settings, Settings)
    assert settings.hardware.name != "auto" and settings.model.dtype != "auto"
    build_if_the_model_is_here(settings)


def build_if_the_model_is_here(settings):
    """The pipeline of a config that fits this machine is built for real (v41_flash only where its weights are)."""
    path = settings.model.path
    if not (path.startswith("embedded:") or os.path.isdir(path)):
        return
    if settings.parallel.world_size > 1:  # each rank loads its own share: tests/test_parallel_engine.py
        return
    one_thread = dataclasses.replace(settings.runtime, num_threads=1)
    program, final = load_program(dataclasses.replace(settings, runtime=one_thread))
    replay = ["replay"] if settings.yoco.mode != "off" else []  # yoco=mask|compact: the replay stage
    assert [s.name for s in program.stages] == ["tokenize", "prefill", *replay, "decode", "sample"]
    assert final.engine.max_model_len == program.model.config.max_position_embeddings


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_resolves_on_its_hardware_and_names_the_runnable_recipe_elsewhere(recipe):
    cfg = compose([f"+recipe={recipe}"])
    assert cfg.recipe == recipe
    target = {"tiny_cpu": CPU, "flash_sm90": H200, "flash_sm100": B200}.get(recipe)
    if target is not None:
        assert resolve(cfg, found=target).hardware.name == target.preset
    if target is CPU:
        build_if_the_model_is_here(resolve(cfg, found=CPU))
    if recipe != "tiny_cpu":
        message = one_line_error([f"+recipe={recipe}"], CPU)
        assert message.startswith(f"recipe {recipe} needs ")
        assert "found: no CUDA device" in message and "+recipe=tiny_cpu" in message


def test_the_recipes_are_the_files_of_the_top_level_recipes_folder():
    shipped = sorted(p.name[:-5] for p in resources.files("deepinfer.recipes").iterdir() if p.name.endswith(".yaml"))
    assert shipped == recipe_names() == ["flash_ascend950", "flash_sm100", "flash_sm90", "tiny_cpu"]


def test_flash_recipes_serve_v41_flash_and_tiny_cpu_the_embedded_model():
    assert compose(["+recipe=flash_sm100"]).model.name == "v41_flash"
    assert compose(["+recipe=flash_sm90"]).hardware.backends.default[0] == "tilelang-sm90"
    assert compose(["+recipe=tiny_cpu"]).model.path == "embedded:tiny"


# ---- one-line user errors ------------------------------------------------------------------------------------
def test_unknown_key_names_the_key_and_the_allowed_keys():
    message = one_line_error(["foo=1"])
    assert message.startswith("foo=1: unknown config key 'foo'; allowed at the top level: hardware, ")
    assert "sampling" in message


def test_unknown_key_added_with_plus_is_rejected_by_the_resolve_step():
    assert one_line_error(["+foo=1"]).startswith("foo=1: unknown config key 'foo'")
    assert "allowed in 'engine': max_num_seqs" in one_line_error(["+engine.bar=2"])


def test_out_of_range_value_names_key_value_and_range():
    assert one_line_error(["sampling.top_p=2"]) == "sampling.top_p=2.0 is out of range; allowed: (0, 1]"
    assert "allowed: -1 (off) or an integer >= 1" in one_line_error(["sampling.top_k=0"])
    assert one_line_error(["sampling.temperature=nan"]).startswith("sampling.temperature=nan is out of range")
    assert one_line_error(["engine.process=thread"]) == (
        "engine.process='thread' is not allowed; allowed: subprocess, inproc"
    )


def test_wrong_type_names_key_value_and_type():
    assert one_line_error(["engine.max_num_seqs=many"]) == (
        "engine.max_num_seqs=many has the wrong type; allowed: an integer in [1, 65536]"
    )


def test_unknown_group_option_lists_the_options():
    assert one_line_error(["hardware=tpu"]) == (
        "hardware=tpu is not an option of config group 'hardware'; allowed: ascend950, auto, cpu, sm100, sm90"
    )


def test_ascend950_without_torch_npu_fails_clearly():
    message = one_line_error(["hardware=ascend950"])
    assert "needs an Ascend NPU through torch_npu" in message and "found: " in message


def test_a_stage_component_that_is_not_registered_is_rejected_before_loading():
    message = one_line_error(["pipeline.stages.sample.component=beam"])
    assert message == "pipeline.stages.sample.component='beam' is not a registered sample component; allowed: sampler"


def test_hydra_errors_are_told_apart_by_type_not_by_their_text():
    """explain() reads the exception's type and attributes (Hydra's override parse, a sweep in run mode, a
    missing interpolation), never its message text."""
    assert one_line_error(["engine.max_num_seqs=[1"]).startswith("engine.max_num_seqs=[1: ")
    assert one_line_error(["sampling.top_p=0.5,3"]) == (
        "sampling.top_p=0.5,3 is ambiguous; allowed: --multirun to sweep over it, sampling.top_p=[0.5,3] for a "
        "list, sampling.top_p='0.5,3' for a string")
    message = one_line_error(["engine.max_num_seqs=${oc.env:DEEPINFER_TEST_NOT_SET}"])
    assert message.startswith("engine.max_num_seqs=${oc.env:DEEPINFER_TEST_NOT_SET} cannot be resolved: ")


def test_a_sweep_expands_as_hydras_basic_sweeper_does():
    from deepinfer.cli.hydra_callbacks import MAX_CHECKED_JOBS, job_overrides

    assert job_overrides(["a=1,2", "b=x", "c=y,z"]) == [
        ["a=1", "b=x", "c=y"], ["a=1", "b=x", "c=z"], ["a=2", "b=x", "c=y"], ["a=2", "b=x", "c=z"]]
    assert job_overrides(["b=x"], sweeper_params={"a": "1,2"}) == [["a=1", "b=x"], ["a=2", "b=x"]]
    assert len(job_overrides(["a=range(0,100)"])) == MAX_CHECKED_JOBS


def test_no_import_cycle_among_the_entry_point_the_cli_and_config():
    """deepinfer/__main__.py imports the CLI and config modules; nothing below imports it, and no two of them
    import each other (issue 23: the callbacks called the CLI's checks, errors and compose imported each other)."""
    import ast

    root = Path(__file__).parents[1] / "deepinfer"
    files = [root / "__main__.py", *(root / "config").glob("*.py"), *(root / "cli").glob("*.py")]
    name = {f: "deepinfer." + ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            for f in files}
    mods = set(name.values())
    graph = {}
    for f, m in name.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[m] = (found & mods) - {m}
    assert not any("deepinfer.__main__" in deps for deps in graph.values())

    def reaches(start, goal, seen=()):
        return any(d == goal or (d not in seen and reaches(d, goal, (*seen, d))) for d in graph[start])

    assert [m for m in graph if reaches(m, m)] == []


# ---- auto, dtypes, memory --------------------------------------------------------------------------------
def test_auto_hardware_becomes_the_detected_preset_in_one_step():
    s = settle(["hardware=auto"], found=H200)
    assert (s.hardware.name, s.hardware.device, s.hardware.dtype) == ("sm90", "cuda", "bfloat16")
    assert s.hardware.backends["default"] == ("tilelang-sm90", "torch")
    assert s.model.dtype == "bfloat16"
    assert settle(["hardware=auto"], found=CPU).hardware.name == "cpu"


def test_explicit_dtype_wins_over_the_hardware_dtype():
    assert settle(["model.dtype=bfloat16"]).model.dtype == "bfloat16"
    assert settle([]).model.dtype == "float32"


def test_memory_fraction_is_resolved_once_into_the_engines_limit_of_total_device_memory():
    """cache.memory_fraction has one meaning (vLLM's gpu_memory_utilization): the share of the device's TOTAL
    memory the engine may use, weights included. The resolve step turns it into cache.memory_limit (bytes), and
    the engine core gives the caches what the loaded model leaves of it."""
    s = settle(["cache.memory_fraction=0.25"])
    assert s.cache.memory_limit == int(hw.cpu_memory_bytes() * 0.25) and s.cache.memory_budget is None
    assert settle(["hardware=auto"], found=H200).cache.memory_limit == int(141 * 2**30 * 0.5)
    assert settle(["cache.memory_budget=5000"]).cache.memory_budget == 5000
    assert settle(["cache.memory_limit=8192"]).cache.memory_limit == 8192
    with pytest.raises(ConfigError, match="cache.memory_limit=.* is out of range; allowed: at most the cuda"):
        settle(["hardware=auto", f"cache.memory_limit={142 * 2**30}"], found=H200)


def test_the_engine_gives_the_caches_what_the_model_leaves_of_the_limit():
    import torch

    from deepinfer.engine.core import cache_budget

    class Backend:
        device = "cpu"
        model = torch.nn.Linear(16, 16)  # 16 * 16 + 16 float32 parameters: 1088 bytes

    from options_helpers import engine_options

    assert cache_budget(engine_options(memory_limit=10_000), Backend()) == 10_000 - 1088
    assert cache_budget(engine_options(memory_budget=5000, memory_limit=10_000), Backend()) == 5000
    with pytest.raises(ValueError, match="leaves the caches nothing: the model takes 1088 B"):
        cache_budget(engine_options(memory_limit=1000), Backend())


def test_max_model_len_defaults_to_the_model_limit_and_may_not_exceed_it():
    s = settle([])
    assert with_model_limits(s, 4096).engine.max_model_len == 4096
    assert with_model_limits(settle(["engine.max_model_len=100"]), 4096).engine.max_model_len == 100
    with pytest.raises(ConfigError, match=r"engine.max_model_len=5000 is out of range; allowed: \[1, 4096\]"):
        with_model_limits(settle(["engine.max_model_len=5000"]), 4096)


def test_resolved_settings_are_frozen_plain_objects():
    s = settle(["+recipe=tiny_cpu"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.engine.max_num_seqs = 3

    def walk(x):
        assert not isinstance(x, DictConfig)
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(s)
    assert type(s.engine).__name__ == "EngineSettings" and s.engine.max_num_seqs == 64


def test_sampling_defaults_become_sampling_params():
    # model=tiny_random: the default model's group sets its own sampling defaults (tests/test_default_model.py)
    params = settle(["model=tiny_random", "sampling.top_k=5", "sampling.stop=[x]"]).sampling.params(max_tokens=3)
    assert (params.top_k, params.stop, params.max_tokens, params.temperature) == (5, ["x"], 3, 1.0)


# ---- environment variables ---------------------------------------------------------------------------------
def test_env_var_precedence_is_cli_over_env_over_yaml(monkeypatch):
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    assert settle([]).runtime.batch_invariant is False  # YAML default
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert settle([]).runtime.batch_invariant is True  # env over YAML
    assert settle(["runtime.batch_invariant=false"]).runtime.batch_invariant is False  # CLI over env


def test_every_documented_env_var_reaches_its_key(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ZERO_OVERHEAD_SCHEDULING", "0")
    monkeypatch.setenv("DEEPINFER_XGRAMMAR_TIMEOUT", "3.5")
    monkeypatch.setenv("DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES", "1024")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "/models/v41")
    s = settle(["model=v41_flash"])
    assert s.engine.zero_overhead_scheduling is False
    assert (s.sampling.xgrammar_timeout, s.sampling.xgrammar_cache_limit_bytes) == (3.5, 1024)
    assert s.model.path == "/models/v41"
    assert settle(["model=v41_flash", "model.path=/other"]).model.path == "/other"


def test_hf_model_dir_unset_means_the_hub_id(monkeypatch):
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    assert settle(["model=v41_flash"]).model.path == "deepseek-ai/DeepSeek-V4.1-Flash-1017"


def test_a_malformed_env_value_names_the_key_and_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "maybe")
    message = one_line_error([])
    assert message.startswith("runtime.batch_invariant=${oc.env:DEEPINFER_BATCH_INVARIANT,false} resolved to 'maybe'")


# ---- the Python API composes the same config ---------------------------------------------------------------
def test_llm_keywords_are_cli_overrides():
    ov = overrides_for("some/dir", hardware="cpu", dtype="float32", engine={"max_num_seqs": 8}, seed=3)
    assert ov == ["model.path='some/dir'", "hardware=cpu", "model.dtype='float32'", "engine.max_num_seqs=8", "runtime.seed=3"]
    api = settle(ov)
    cli = settle(["model.path=some/dir", "hardware=cpu", "model.dtype=float32", "engine.max_num_seqs=8", "runtime.seed=3"])
    assert api == cli
    assert overrides_for("v41_flash") == ["model=v41_flash"]
    with pytest.raises(ConfigError, match="unknown argument 'colour'"):
        overrides_for(None, colour="red")


def test_compose_works_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert compose([]).model.name == "tiny"
    assert os.getcwd() == str(tmp_path)
