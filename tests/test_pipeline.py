"""The component registry and the builder: conf/pipeline/default.yaml -> StepProgram."""

from pathlib import Path

import pytest
import torch

from deepinfer.api import load_settings
from deepinfer.config.errors import ConfigError
from deepinfer.config.hardware import Found
from deepinfer.kernels.registry import BackendError
from deepinfer.models import ForwardBatch
from deepinfer.config.components import REGISTRY
from deepinfer.pipeline import StepProgram, build_program, load_program

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek_v41"
TINY = str(FIXTURES / "tiny-swa-csa2")
CPU = Found("cpu", "cpu", "CPU only")


def program_for(*overrides):
    settings = load_settings([f"model.path='{TINY}'", "runtime.num_threads=1", *overrides], CPU)
    return load_program(settings)


def test_registry_holds_a_component_for_every_required_stage():
    assert REGISTRY.names("tokenize") == ["hf_tokenizer"]
    assert REGISTRY.names("prefill") == REGISTRY.names("decode") == ["model_forward"]
    assert REGISTRY.names("sample") == ["sampler"]
    assert REGISTRY.names("replay") == ["yoco_compact", "yoco_mask"]  # YOCO bounded replay (yoco=mask|compact)
    forward = REGISTRY.get("decode", "model_forward")
    assert forward.supports("torch") and forward.supports("tilelang-sm90") and "cpu" in forward.devices


def test_default_pipeline_builds_the_stages_in_order_without_replay_while_yoco_is_off():
    program, settings = program_for()
    assert isinstance(program, StepProgram)
    assert [s.name for s in program.stages] == ["tokenize", "prefill", "decode", "sample"]
    assert program.replay is None
    assert settings.engine.max_model_len == 1024  # the fixture's max_position_embeddings, resolved after load


def test_program_stages_run_a_request_end_to_end():
    program, _ = program_for()
    ids = program.tokenize.encode("The cat")
    assert ids[0] == 0  # BOS from the tokenizer's post-processor
    state = program.new_state()
    logits = program.prefill(ForwardBatch([ids], [state]))
    assert logits.shape == (1, 512) and logits.dtype == torch.float32
    logits = program.decode(ForwardBatch([[int(logits.argmax())]], [state]))
    assert logits.shape == (1, 512)
    assert program.tokenize.decode(program.tokenize.encode("The cat")) == "The cat"


def test_summary_names_each_stage_component_and_each_op_backend():
    summary = program_for()[0].summary()
    assert summary["stages"] == {
        "tokenize": "hf_tokenizer", "prefill": "model_forward", "decode": "model_forward", "sample": "sampler"
    }
    assert set(summary["ops"].values()) == {"torch"} and "sink_attention" in summary["ops"]
    assert summary["fallbacks"] == {}


def test_a_preferred_backend_missing_here_is_a_visible_fallback(caplog):
    program, _ = program_for("hardware.backends={default:[tilelang-sm90,torch]}")
    summary = program.summary()
    assert summary["ops"]["linear"] == "torch (fallback)"
    assert "tilelang-sm90 unavailable on cpu" in summary["fallbacks"]["linear"]
    assert "kernel fallback" in caplog.text


def test_strict_backends_turn_a_missing_backend_into_an_error():
    with pytest.raises(BackendError, match="none of the backends"):
        program_for("hardware.backends={default:[tilelang-sm90]}", "hardware.strict_backends=true")


def test_stages_out_of_order_or_missing_are_config_errors():
    with pytest.raises(ConfigError, match="pipeline.stages.sample.component is required"):
        load_settings(["pipeline.stages.sample.component=null"], CPU)
    with pytest.raises(ConfigError, match="needs YOCO"):
        load_settings(["pipeline.stages.replay.component=model_forward"], CPU)


def test_a_component_is_a_hydra_partial_and_its_options_are_its_keyword_arguments():
    comp = REGISTRY.get("replay", "yoco_compact")
    assert comp.factory == {"_target_": "deepinfer.pipeline.components.yoco_compact", "_partial_": True,
                            "_convert_": "all"}
    assert comp.option_names() == ["keep_tokens"] and REGISTRY.get("decode", "model_forward").option_names() == []
    assert comp.load({"keep_tokens": 7}).keywords == {"keep_tokens": 7}
    with pytest.raises(ConfigError, match="pipeline.stages.decode.options.beam: not an option of component "
                                          "'model_forward'; allowed: none"):
        program_for("+pipeline.stages.decode.options.beam=2")
    with pytest.raises(ConfigError, match=r"^\+pipeline.stages.polish={component: x}: "):
        load_settings(["+pipeline.stages.polish={component: x}"], CPU)  # new stages come from YAML, not the CLI


def test_build_program_checks_the_component_can_serve_the_device():
    program, settings = program_for()

    class NpuModel:  # a model placed on another device type (only .device and .ops are read before the check)
        device = "meta"
        ops = program.model.ops

    with pytest.raises(ConfigError, match="cannot run on device 'meta'"):
        build_program(settings.pipeline, NpuModel(), program.sample)
