"""Engine configuration for tests, built the product's way.

settings_for: resolved Settings for a model, through the config's compose and resolve step (LLM's and the CLI's
path), on the CPU. Tests build engines from settings (LLMEngine.for_settings, SettingsBackend): the engine under
test is the product's, its model loaded by the settings path (sampler over the tokenizer's vocabulary, DSpark's
draft layers only with decoding=dspark).

engine_options: EngineOptions for tests that need options without a model (messages, schedulers): the schema's
defaults (deepinfer/config/schema.py, the one place for them) through EngineOptions' one constructor, then the
fields a test sets by name."""

from deepinfer.api import load_settings, overrides_for
from deepinfer.config.hardware import Found
from deepinfer.config.schema import Settings
from deepinfer.engine.options import EngineOptions

CPU = Found("cpu", "cpu", "no CUDA device and no torch_npu (CPU only)")


def settings_for(model: str, *overrides: str, **kwargs) -> Settings:
    """Settings for `model` (a checkpoint directory, a hub id, embedded:NAME or a conf/model option) on the CPU.
    overrides: Hydra override strings ("decoding=dspark", "decoding.num_draft_tokens=2"); kwargs: LLM's keyword
    arguments (engine={"max_num_seqs": 8}, memory_budget=..., process="inproc")."""
    return load_settings(overrides_for(str(model), overrides, **{"hardware": "cpu", **kwargs}), found=CPU)


def engine_options(**overrides) -> EngineOptions:
    return EngineOptions.for_settings(Settings(), **overrides)
